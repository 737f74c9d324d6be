"""The float tile loops over L1-resident operands, in TSC ticks per FMA: how
fast each register-tile shape and loop order runs on this core, apart from
memory (see docs/design/batch-invariance.md, "The float tiles").

    python3 benches/probes/tile_loops.py > /tmp/tile_loops.c
    gcc -O2 -mavx2 -mfma -mf16c -masm=intel /tmp/tile_loops.c -o /tmp/tile_loops
    /tmp/tile_loops

Each loop runs K = 576 elements (a SmolLM2 row) of R weight rows x T tokens,
8 lanes per accumulator, 20000 times. `xreg`: the tokens' x vectors loaded
into registers, each row's weights converted (F16) or read (F32) once per
step into one register (the x-first order, and the AVX2 4x3 asm loop);
`xmem`: the R rows' weights first, each into its own register, then each
token's x read by the FMAs (the weights-first order of the two-row tiles).
`fma12` is 12 independent FMAs on registers: the core's FMA rate. Not a
cargo target; run it on a quiet machine, three rounds are printed.
"""
K = 576
variants = []
def loop(name, R, T, dt, mode):
    # mode: xreg (x in regs, w converted/loaded into ymm15), xmem (w in regs, x memory operands)
    acc = lambda i, j: f"ymm{i*T+j}"
    lines = []
    if mode == "xreg":
        assert R*T + T + (1 if dt=="f16" else 0) <= 16
        for j in range(T):
            lines.append(f"vmovups ymm{R*T+j}, ymmword ptr [%[x{j}] + 4*%[e]]")
        for i in range(R):
            if dt == "f16":
                lines.append(f"vcvtph2ps ymm15, xmmword ptr [%[w{i}] + 2*%[e]]")
                for j in range(T):
                    lines.append(f"vfmadd231ps {acc(i,j)}, ymm15, ymm{R*T+j}")
            else:
                for j in range(T):
                    lines.append(f"vfmadd231ps {acc(i,j)}, ymm{R*T+j}, ymmword ptr [%[w{i}] + 4*%[e]]")
    elif mode == "xmem":
        assert R*T + R <= 16
        for i in range(R):
            if dt == "f16":
                lines.append(f"vcvtph2ps ymm{R*T+i}, xmmword ptr [%[w{i}] + 2*%[e]]")
            else:
                lines.append(f"vmovups ymm{R*T+i}, ymmword ptr [%[w{i}] + 4*%[e]]")
        for j in range(T):
            for i in range(R):
                lines.append(f"vfmadd231ps {acc(i,j)}, ymm{R*T+i}, ymmword ptr [%[x{j}] + 4*%[e]]")
    elif mode == "fma":
        for i in range(R*T):
            lines.append(f"vfmadd231ps ymm{i}, ymm14, ymm15")
    body = "\n".join(f'"{l}\\n\\t"' for l in lines)
    ops = ", ".join([f'[x{j}] "r" (x + {j}*K)' for j in range(T)] + [f'[w{i}] "r" ((const char*)w + {i}*K*ES)' for i in range(R)])
    es = 2 if dt == "f16" else 4
    return f'''
static double {name}(const float *x, const void *w, long reps) {{
    const long ES = {es};
    uint64_t t0 = __rdtsc();
    for (long r = 0; r < reps; r++) {{
        long e = 0;
        __asm__ volatile(
            "vxorps ymm0, ymm0, ymm0\\n\\t"
            "2:\\n\\t"
            {body}
            "add %[e], 8\\n\\t"
            "cmp %[e], %[n]\\n\\t"
            "jb 2b\\n\\t"
            : [e] "+r" (e)
            : {ops}, [n] "r" ((long)K)
            : "memory", "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15");
    }}
    uint64_t t1 = __rdtsc();
    double fmas = (double)reps * (K/8) * {R*T};
    return (double)(t1 - t0) / fmas;  /* TSC ticks per FMA */
}}
'''
cases = [("fma12", 4, 3, "f32", "fma"),
 ("f16_4x3_xreg", 4, 3, "f16", "xreg"),
 ("f16_4x2_xreg", 4, 2, "f16", "xreg"),
 ("f16_2x5_xreg", 2, 5, "f16", "xreg"),
 ("f16_2x4_xmem", 2, 4, "f16", "xmem"),
 ("f16_2x5_xmem", 2, 5, "f16", "xmem"),
 ("f16_2x4_xreg", 2, 4, "f16", "xreg"),
 ("f16_1x7_xreg", 1, 7, "f16", "xreg"),
 ("f16_2x6_xmem", 2, 6, "f16", "xmem"),
 ("f16_2x7_xmem", 2, 7, "f16", "xmem"),
 ("f16_3x4_xmem", 3, 4, "f16", "xmem"),
 ("f16_1x9_xmem", 1, 9, "f16", "xmem"),
 ("f16_1x10_xmem", 1, 10, "f16", "xmem"),
 ("f32_4x3_xreg", 4, 3, "f32", "xreg"),
 ("f32_3x4_xreg", 3, 4, "f32", "xreg"),
 ("f32_2x5_xreg", 2, 5, "f32", "xreg"),
 ("f32_2x4_xmem", 2, 4, "f32", "xmem"),
 ("f32_2x6_xmem", 2, 6, "f32", "xmem"),
 ("f32_2x7_xmem", 2, 7, "f32", "xmem"),
 ("f32_1x9_xmem", 1, 9, "f32", "xmem"),
]
print('#include <stdio.h>\n#include <stdint.h>\n#include <x86intrin.h>\n#define K %d' % K)
for c in cases:
    print(loop(*c))
print('int main(){ static float x[16*K] __attribute__((aligned(64))); static float w[4*K] __attribute__((aligned(64)));')
print('for(int i=0;i<16*K;i++) x[i]=0.001f; for(int i=0;i<4*K;i++) w[i]=0.0f;')
print('for (int round=0; round<3; round++) {')
for c in cases:
    print(f'  printf("%-16s %.3f ticks/FMA\\n", "{c[0]}", {c[0]}(x, w, 20000));')
print('  printf("\\n"); }\n return 0; }')
