use super::*;
use crate::model::{Family, GateAct, Variant};

fn args(variant: Variant) -> ModelArgs {
    let mut a = ModelArgs::from_params_json(
        r#"{"dim": 64, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 800, "norm_eps": 1e-6}"#,
    )
    .unwrap();
    a.variant = variant;
    a
}

/// What llama.cpp's architecture for a family cannot state is refused
/// by name; each family as transformers configures it is written.
#[test]
fn check_writable_refuses_what_the_architecture_cannot_state() {
    let gemma = Variant {
        family: Family::Gemma3,
        qk_norm: true,
        post_norms: true,
        embed_scale: true,
        gate_act: GateAct::GeluTanh,
        sliding_window: Some(8),
        global_every: Some(6),
        local_rope_theta: Some(1e4),
        ..Default::default()
    };
    let ok = [
        Variant::default(),
        Variant {
            family: Family::Qwen2,
            qkv_bias: true,
            ..Default::default()
        },
        Variant {
            family: Family::Phi3,
            sliding_window: Some(8),
            ..Default::default()
        },
        gemma.clone(),
    ];
    for v in ok {
        assert_eq!(check_writable(&args(v.clone())), Ok(()), "{v:?}");
    }
    let refused = [
        (
            Variant {
                family: Family::Qwen2,
                sliding_window: Some(8),
                ..Default::default()
            },
            "sliding window",
        ),
        (
            Variant {
                global_every: Some(4),
                ..gemma.clone()
            },
            "every 4 layers",
        ),
        (
            Variant {
                post_norms: false,
                ..gemma.clone()
            },
            "without post-norms",
        ),
        (
            Variant {
                family: Family::Qwen3,
                qk_norm: true,
                embed_scale: true,
                ..Default::default()
            },
            "with the embedding scale",
        ),
    ];
    for (v, want) in refused {
        let e = check_writable(&args(v)).unwrap_err();
        assert!(e.contains(want), "{e}");
    }
}
