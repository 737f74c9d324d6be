use super::*;

fn mix(n_layers: usize, is_70b: bool) -> MixInfo {
    MixInfo {
        n_layers,
        is_70b,
        tied: false,
    }
}

/// The layers whose attn_v llama-quantize's Q4_K_M gives Q6_K.
fn q6_layers(m: MixInfo) -> Vec<usize> {
    (0..m.n_layers)
        .filter(|i| {
            target_type(
                OutType::Q4_K_M,
                &format!("blk.{i}.attn_v.weight"),
                &[1024, 4096],
                m,
            ) == DType::Q6_K
        })
        .collect()
}

#[test]
fn q4_k_m_mix() {
    // use_more_bits over 32 layers (Llama 3 8B): the first and last
    // 4, and every third from layer 6.
    assert_eq!(
        q6_layers(mix(32, false)),
        vec![0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    );
    let m70 = mix(80, true);
    let m = mix(8, false);
    let tied = MixInfo { tied: true, ..m };
    use DType::*;
    const Q4_K_M: OutType = OutType::Q4_K_M;
    #[rustfmt::skip]
    let cases: &[(OutType, &str, &[usize], MixInfo, DType)] = &[
        // 70B-shaped: the other attn_v are Q5_K, ffn_down unchanged.
        (Q4_K_M, "blk.40.attn_v.weight", &[1024, 8192], m70, Q5_K),
        (Q4_K_M, "blk.12.attn_v.weight", &[1024, 8192], m70, Q6_K),
        (Q4_K_M, "blk.40.ffn_down.weight", &[8192, 28672], m70, Q4_K),
        // Phi-3's fused QKV is an attn_v to llama-quantize.
        (Q4_K_M, "blk.0.attn_qkv.weight", &[1536, 512], m, Q6_K),
        (Q4_K_M, "blk.4.attn_qkv.weight", &[1536, 512], m, Q4_K),
        // Fallbacks by row length.
        (Q4_K_M, "blk.4.attn_q.weight", &[576, 576], m, Q5_0),
        (Q4_K_M, "blk.0.ffn_down.weight", &[576, 1536], m, Q6_K),
        (Q4_K_M, "blk.0.ffn_down.weight", &[576, 704], m, Q8_0),
        (Q4_K_M, "blk.4.attn_q.weight", &[48, 48], m, F16),
        (Q4_K_M, "output.weight", &[800, 576], m, Q8_0),
        (Q4_K_M, "output.weight", &[800, 512], m, Q6_K),
        (Q4_K_M, "output_norm.weight", &[512], m, F32),
        // The tied embedding is the head.
        (Q4_K_M, "token_embd.weight", &[800, 512], tied, Q6_K),
        (Q4_K_M, "token_embd.weight", &[800, 512], m, Q4_K),
        // Q8_0 keeps its head; F16 files are F16.
        (OutType::Q8_0, "output.weight", &[800, 512], m, Q8_0),
        (OutType::F16, "output.weight", &[800, 512], m, F16),
    ];
    for &(file, name, shape, info, want) in cases {
        assert_eq!(
            target_type(file, name, shape, info),
            want,
            "{file:?} {name} {shape:?}"
        );
    }
}
