use super::*;

#[test]
fn rejects_os_system() {
    let p = b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85R.";
    assert_eq!(
        unpickle(p).unwrap_err(),
        PickleError::DisallowedGlobal("os.system".into())
    );
}

#[test]
fn simple_dict() {
    // pickle.dumps({'a': 1, 'b': [True, None]}, protocol=2)
    let p = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01K\x01X\x01\x00\x00\x00bq\x02]q\x03(\x88Neu.";
    let v = unpickle(p).unwrap();
    let Value::Dict(d, _) = v else {
        panic!("not a dict")
    };
    assert_eq!(d.len(), 2);
    assert_eq!(d[0], (Value::Str("a".into()), Value::Int(1)));
    let Value::List(l, _) = &d[1].1 else {
        panic!("not a list")
    };
    assert_eq!(**l, vec![Value::Bool(true), Value::None]);
}

#[test]
fn long1_negative() {
    // pickle.dumps(-2**40, protocol=2)
    let p = b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\xff.";
    assert_eq!(unpickle(p).unwrap(), Value::Int(-(1i64 << 40)));
}

#[test]
fn deep_nesting_is_limited() {
    let mut p = vec![0x80, 2, b')'];
    p.extend(std::iter::repeat_n(0x85u8, 10_000));
    p.push(b'.');
    assert!(matches!(unpickle(&p), Err(PickleError::Limit { .. })));
}

#[test]
fn truncated_string() {
    let p = b"\x80\x02X\xff\xff\xff\x7fab";
    assert!(matches!(
        unpickle(p),
        Err(PickleError::Truncated {
            need: 0x7fffffff,
            ..
        })
    ));
}

#[test]
fn protocol4_frame_memoize_short_unicode() {
    // pickle.dumps((1.5, 'é', [1, 2], {'k': (3,)}), protocol=4)
    let p = b"\x80\x04\x95%\x00\x00\x00\x00\x00\x00\x00(G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x02\xc3\xa9\x94]\x94(K\x01K\x02e}\x94\x8c\x01k\x94K\x03\x85\x94st\x94.";
    let Value::Tuple(t, _) = unpickle(p).unwrap() else {
        panic!("not a tuple")
    };
    assert_eq!(t.len(), 4);
    assert_eq!(t[0], Value::Float(1.5));
    assert_eq!(t[1], Value::Str("é".into()));
    let Value::List(l, _) = &t[2] else {
        panic!("not a list")
    };
    assert_eq!(**l, vec![Value::Int(1), Value::Int(2)]);
    let Value::Dict(d, _) = &t[3] else {
        panic!("not a dict")
    };
    assert_eq!(d[0].0, Value::Str("k".into()));
    assert!(matches!(&d[0].1, Value::Tuple(x, _) if x[..] == [Value::Int(3)]));
}

#[test]
fn ints_of_every_width() {
    // pickle.dumps((70000, -5, 2**63-1), protocol=2)
    let p = b"\x80\x02Jp\x11\x01\x00J\xfb\xff\xff\xff\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x87.";
    let Value::Tuple(t, _) = unpickle(p).unwrap() else {
        panic!("not a tuple")
    };
    assert_eq!(
        t[..],
        [Value::Int(70000), Value::Int(-5), Value::Int(i64::MAX)]
    );
    // 9-byte LONG1 (2**64) does not fit.
    let p = b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.";
    assert!(matches!(
        unpickle(p),
        Err(PickleError::Malformed { offset: 2, .. })
    ));
}

#[test]
fn malformed_streams_are_errors() {
    let cases: &[(&[u8], &str)] = &[
        (b"\x80\x02h\x05.", "memo key 5"),
        (b"\x80\x02}K\x01s.", "expected a value on top"),
        (b"\x80\x020.", "stack underflow"),
        (b"\x80\x02](K\x01K\x02u.", "SETITEM on a list"),
        (b"\x80\x02}(K\x01u.", "odd number"),
        (b"\x80\x02N}K\x01K\x02sb.", "BUILD with a non-empty dict"),
        (b"\x80\x02K\x01)R.", "REDUCE on a int"),
        (b"\x80\x02K\x01Q.", "persistent id is a int"),
        (b"\x80\x02(.", "MARK"),
        (b"\x80\x02t.", "no MARK"),
    ];
    for (p, want) in cases {
        let e = unpickle(p).unwrap_err().to_string();
        assert!(e.contains(want), "{p:?}: {e}");
    }
    assert_eq!(unpickle(b"\x80\x02K\x01").unwrap_err(), PickleError::NoStop);
    assert!(matches!(
        unpickle(b"\x80\x02I1\n."),
        Err(PickleError::UnsupportedOpcode {
            opcode: b'I',
            offset: 2
        })
    ));
    // STACK_GLOBAL is checked like GLOBAL.
    let p = b"\x80\x04\x8c\x08builtins\x8c\x04exec\x93.";
    assert_eq!(
        unpickle(p).unwrap_err(),
        PickleError::DisallowedGlobal("builtins.exec".into())
    );
}

#[test]
fn copy_on_write_work_is_bounded() {
    // ]  then n x (q 0, K 1, a): every APPEND copies the list the memo
    // shares, so work grows quadratically and must hit the limit.
    let mut p = vec![0x80, 2, b']'];
    for _ in 0..5000 {
        p.extend_from_slice(b"q\x00K\x01a");
    }
    p.push(b'.');
    let limits = Limits {
        max_work: 1_000_000,
        ..Limits::default()
    };
    assert!(matches!(
        unpickle_with_limits(&p, limits),
        Err(PickleError::Limit { .. })
    ));
    // Without memo sharing the same number of appends is cheap.
    let mut p = vec![0x80, 2, b']'];
    for _ in 0..5000 {
        p.extend_from_slice(b"K\x01a");
    }
    p.push(b'.');
    let Value::List(l, _) = unpickle_with_limits(&p, limits).unwrap() else {
        panic!("not a list")
    };
    assert_eq!(l.len(), 5000);
}

#[test]
fn memo_and_stack_limits() {
    let limits = Limits {
        max_memo: 10,
        max_stack: 10,
        ..Limits::default()
    };
    let mut p = vec![0x80, 2, b'N'];
    for i in 0..11u8 {
        p.extend_from_slice(&[b'q', i]);
    }
    p.push(b'.');
    assert!(unpickle_with_limits(&p, limits)
        .unwrap_err()
        .to_string()
        .contains("memo larger than 10"));
    let mut p = vec![0x80, 2];
    p.extend(std::iter::repeat_n(b'N', 11));
    p.push(b'.');
    assert!(unpickle_with_limits(&p, limits)
        .unwrap_err()
        .to_string()
        .contains("stack deeper than 10"));
}
