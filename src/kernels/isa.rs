//! The instruction-set level every kernel family dispatches on.
//!
//! The CPU is probed once ([`Isa::detect`]); [`Isa::current`] is that level,
//! or a lower one named by the environment variable `LLAMA_GRAPH_ISA`
//! (`scalar`, `avx2`, `avx512`, `avx512vnni`), read once per process, so that
//! tests and benchmarks can run the kernels of the AVX2 class on an AVX-512
//! machine. The CLI checks the variable first ([`Isa::from_env`]) and refuses
//! a value it does not know or that this CPU cannot run.
//!
//! Levels are ordered: each includes everything below it. A kernel family
//! with no variant for a level uses the best one below it (for example the
//! quantized fast path has no plain-AVX-512 kernel and runs its AVX2 one there).

use std::fmt;
use std::sync::OnceLock;

/// An instruction-set level of the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust: the reference every SIMD kernel is tested against.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64 laptops, desktops and most cloud VMs).
    Avx2,
    /// AVX2 plus AVX-512 F/BW/VL.
    Avx512,
    /// AVX-512 plus VNNI (`vpdpbusd`).
    Avx512Vnni,
}

/// The environment variable that caps [`Isa::current`].
pub const ISA_ENV: &str = "LLAMA_GRAPH_ISA";

impl Isa {
    /// Every level, lowest first. An aarch64 NEON level would be a variant
    /// after `Scalar` that [`Isa::supported`] accepts only on that
    /// architecture (today `supported` compares against [`Isa::detect`],
    /// which is `Scalar` off x86-64), with a `neon()` predicate like
    /// [`Isa::avx2`]; the float matmuls take a level's kernels through
    /// one trait (`matmul::tiles::Tiles`), where a 4-lane NEON set slots in.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni];

    /// The name `LLAMA_GRAPH_ISA` and the reports use.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    /// Parses a level name.
    pub fn from_name(s: &str) -> Result<Isa, String> {
        Isa::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!(
                    "unknown instruction-set level {s:?}: use one of {}",
                    Isa::ALL.map(Isa::name).join(", ")
                )
            })
    }

    /// True if this CPU can run the level.
    pub fn supported(self) -> bool {
        self <= Isa::detect()
    }

    /// The highest level this CPU supports (probed once).
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(probe)
    }

    /// The level named by `LLAMA_GRAPH_ISA`, if set: an error names a value
    /// that is not a level or that this CPU cannot run.
    pub fn from_env() -> Result<Option<Isa>, String> {
        let Ok(v) = std::env::var(ISA_ENV) else {
            return Ok(None);
        };
        if v.trim().is_empty() {
            return Ok(None);
        }
        let want = Isa::from_name(&v).map_err(|e| format!("{ISA_ENV}: {e}"))?;
        if !want.supported() {
            return Err(format!(
                "{ISA_ENV}={v}: this CPU supports at most {} (a level can be lowered, not raised)",
                Isa::detect()
            ));
        }
        Ok(Some(want))
    }

    /// The level the kernels run at: [`Isa::detect`], capped by
    /// `LLAMA_GRAPH_ISA` when that names a level this CPU supports (an
    /// invalid value is ignored here; the CLI reports it before any work).
    pub fn current() -> Isa {
        static CURRENT: OnceLock<Isa> = OnceLock::new();
        *CURRENT.get_or_init(|| Isa::from_env().ok().flatten().unwrap_or(Isa::detect()))
    }

    /// Every level this CPU supports, lowest first (for tests that run each
    /// kernel family at each level).
    pub fn supported_levels() -> impl Iterator<Item = Isa> {
        Isa::ALL.into_iter().filter(|l| l.supported())
    }

    /// AVX2 + FMA + F16C kernels may run.
    pub fn avx2(self) -> bool {
        self >= Isa::Avx2
    }

    /// AVX-512 F/BW/VL kernels may run.
    pub fn avx512(self) -> bool {
        self >= Isa::Avx512
    }

    /// AVX-512 VNNI kernels may run.
    pub fn vnni(self) -> bool {
        self >= Isa::Avx512Vnni
    }

    /// AVX-512 BF16 (`vdpbf16ps`) may run: an extension beyond the levels,
    /// used only by the opt-in bf16-activation matmul.
    pub fn avx512_bf16(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static BF16: OnceLock<bool> = OnceLock::new();
            self.avx512() && *BF16.get_or_init(|| std::is_x86_feature_detected!("avx512bf16"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn probe() -> Isa {
    use std::is_x86_feature_detected as has;
    if !(has!("avx2") && has!("fma") && has!("f16c")) {
        return Isa::Scalar;
    }
    if !(has!("avx512f") && has!("avx512bw") && has!("avx512vl")) {
        return Isa::Avx2;
    }
    if !has!("avx512vnni") {
        return Isa::Avx512;
    }
    Isa::Avx512Vnni
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> Isa {
    Isa::Scalar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order() {
        for l in Isa::ALL {
            assert_eq!(Isa::from_name(l.name()), Ok(l));
        }
        assert!(Isa::from_name("sse9").unwrap_err().contains("avx2"));
        assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx512 < Isa::Avx512Vnni);
        assert!(Isa::Scalar.supported());
        assert_eq!(Isa::supported_levels().last(), Some(Isa::detect()));
    }
}
