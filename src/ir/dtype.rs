//! Element types of tensors: activations, weights (including block-quantized
//! GGUF formats) and token ids.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a tensor.
///
/// Quantized types store weights in fixed-size blocks; `block_elems` and
/// `block_bytes` give the layout. Every other type is one element per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[allow(non_camel_case_types)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16 (Meta's checkpoints).
    BF16,
    /// 32-bit signed integer (token ids, positions, tables).
    I32,
    /// GGUF Q8_0: blocks of 32 8-bit quants with an f16 scale (34 bytes).
    Q8_0,
    /// GGUF Q4_0: blocks of 32 4-bit quants with an f16 scale (18 bytes).
    Q4_0,
    /// GGUF Q4_1: blocks of 32 4-bit quants with an f16 scale and minimum
    /// (20 bytes).
    Q4_1,
    /// GGUF Q5_0: blocks of 32 5-bit quants with an f16 scale (22 bytes).
    Q5_0,
    /// GGUF Q5_1: blocks of 32 5-bit quants with an f16 scale and minimum
    /// (24 bytes).
    Q5_1,
    /// GGUF Q2_K: super-blocks of 256 2-bit quants (84 bytes).
    Q2_K,
    /// GGUF Q3_K: super-blocks of 256 3-bit quants (110 bytes).
    Q3_K,
    /// GGUF Q4_K: super-blocks of 256 4-bit quants with 6-bit sub-block
    /// scales and minimums (144 bytes).
    Q4_K,
    /// GGUF Q5_K: super-blocks of 256 5-bit quants (176 bytes).
    Q5_K,
    /// GGUF Q6_K: super-blocks of 256 6-bit quants with 8-bit sub-block
    /// scales (210 bytes).
    Q6_K,
    /// GGUF IQ4_NL: blocks of 32 4-bit indices into a non-linear table
    /// (18 bytes).
    IQ4_NL,
    /// GGUF IQ4_XS: super-blocks of 256 4-bit non-linear indices with 6-bit
    /// sub-block scales (136 bytes).
    IQ4_XS,
    /// BF16 weights stored losslessly in 49-byte blocks of 32 plus a table
    /// of exceptions after the blocks (see `kernels::bf16z`); made by the
    /// `compress_weights` pass, never read from a file.
    BF16Z,
}

impl DType {
    /// Elements per storage block (1 for plain types).
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::IQ4_NL
            | DType::BF16Z => 32,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => {
                256
            }
        }
    }

    /// Bytes per storage block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::IQ4_NL => 18,
            DType::IQ4_XS => 136,
            DType::BF16Z => 49,
        }
    }

    /// Stored in blocks of more than one element.
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes needed for `n` elements, or `None` when `n` is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// The lower-case name the text dump and error messages use (`q4_K`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2_K => "q2_K",
            DType::Q3_K => "q3_K",
            DType::Q4_K => "q4_K",
            DType::Q5_K => "q5_K",
            DType::Q6_K => "q6_K",
            DType::IQ4_NL => "iq4_nl",
            DType::IQ4_XS => "iq4_xs",
            DType::BF16Z => "bf16z",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(DType::BF16.bytes_for(10), Some(20));
        assert_eq!(DType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(DType::Q4_0.bytes_for(33), None);
        assert_eq!(DType::Q6_K.bytes_for(256), Some(210));
        assert_eq!(DType::Q5_K.bytes_for(512), Some(352));
        assert_eq!(DType::IQ4_XS.bytes_for(256), Some(136));
        assert_eq!(DType::Q5_0.bytes_for(64), Some(44));
        assert_eq!(DType::F32.bytes_for(usize::MAX), None);
    }
}
