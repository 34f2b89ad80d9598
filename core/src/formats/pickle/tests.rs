use super::*;

#[test]
fn scalars_and_containers() {
    // pickle.dumps({'a': [1, 2.5, None, True], 'b': (b'x', 'y')}, protocol=2)
    let data = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01G@\x04\x00\x00\x00\x00\x00\x00N\x88eX\x01\x00\x00\x00bq\x03c_codecs\nencode\nq\x04X\x01\x00\x00\x00xq\x05X\x06\x00\x00\x00latin1q\x06\x86q\x07Rq\x08X\x01\x00\x00\x00yq\x09\x86q\x0au.";
    let v = parse(data).unwrap();
    let PyValue::Dict(items) = v else { panic!() };
    assert_eq!(
        items[0].1,
        PyValue::List(vec![
            PyValue::Int(1),
            PyValue::Float(2.5),
            PyValue::None,
            PyValue::Bool(true)
        ])
    );
    // `_codecs.encode` is never run: it stays an object node.
    let PyValue::Tuple(t) = &items[1].1 else {
        panic!()
    };
    assert!(matches!(&t[0], PyValue::Object(o) if o.class().unwrap().name == "encode"));
}

#[test]
fn attrs_in_any_field_order() {
    // `pickle.dumps((a, b, c), protocol=4)` of three `m.P` objects whose `__dict__`s are
    // {x: 1, y: 2, z: 3}, {z: 30, y: 20, x: 10} and {w: 0, x: 100, q: 5, z: 300}.
    let data = b"\x80\x04\x95\\\x00\x00\x00\x00\x00\x00\x00\x8c\x01m\x94\x8c\x01P\x94\x93\x94)\x81\x94}\x94(\x8c\x01x\x94K\x01\x8c\x01y\x94K\x02\x8c\x01z\x94K\x03ubh\x02)\x81\x94}\x94(h\x07K\x1eh\x06K\x14h\x05K\nubh\x02)\x81\x94}\x94(\x8c\x01w\x94K\x00h\x05Kd\x8c\x01q\x94K\x05h\x07M,\x01ub\x87\x94.";
    let arena = parse_arena(data).unwrap();
    let objs: Vec<ObjRef<'_>> = arena
        .root()
        .items()
        .unwrap()
        .map(|o| o.object().unwrap())
        .collect();
    let ints = |found: &[Option<PyRef<'_>>]| -> Vec<Option<i64>> {
        found.iter().map(|f| f.and_then(|v| v.as_i64())).collect()
    };
    let names = ["x", "y", "z"];
    assert_eq!(ints(&objs[0].attrs(names)), [Some(1), Some(2), Some(3)]);
    assert_eq!(ints(&objs[1].attrs(names)), [Some(10), Some(20), Some(30)]);
    assert_eq!(ints(&objs[2].attrs(names)), [Some(100), None, Some(300)]);
    assert_eq!(ints(&objs[1].attrs(["z", "x"])), [Some(30), Some(10)]);
    assert_eq!(
        ints(&objs[2].attrs(["q", "w", "v"])),
        [Some(5), Some(0), None]
    );
    // One cache over all three records (their keys are memo references to the first
    // record's strings, or new strings), and a name the cache learnt in another position.
    let mut cache = AttrCache::new();
    let got: Vec<_> = objs
        .iter()
        .map(|o| ints(&o.attrs_cached(&mut cache, ["x", "y", "z"])))
        .collect();
    assert_eq!(
        got,
        [
            [Some(1), Some(2), Some(3)],
            [Some(10), Some(20), Some(30)],
            [Some(100), None, Some(300)]
        ]
    );
    for o in &objs {
        for name in ["w", "x", "y", "z", "q"] {
            assert_eq!(
                o.attrs([name])[0].and_then(|v| v.as_i64()),
                o.attr(name).and_then(|v| v.as_i64())
            );
        }
    }
}

#[test]
fn containers_filled_in_interleaved_steps() {
    // Lists and dicts filled in several steps, with other containers filled in between (a
    // second `APPENDS` batch after a tuple was built), sets, frozensets, `DICT`, `LIST`, `()`.
    // Python's `pickle.loads` gives ([1, 3, 5], {10: 11, 12: 13}, {20: 21, 22: 23},
    // [7, (8, 9)], {30, 31}, frozenset({32}), {40: 41}, [42], (), [2, 4]).
    let data = b"\x80\x04(]\x94(K\x01e]\x94(K\x02e0(K\x03K\x05eh\x01(K\x04e0}\x94(K\nK\x0bu}\x94(K\x14K\x15u0(K\x0cK\ruh\x03K\x16K\x17s]\x94(K\x07e(K\x08K\t\x86e\x8f\x94(K\x1eK\x1f\x90(K \x91(K(K)d(K*l)h\x01t.";
    let int = PyValue::Int;
    let ints = |v: &[i64]| v.iter().map(|&i| int(i)).collect::<Vec<_>>();
    let pairs = |v: &[(i64, i64)]| v.iter().map(|&(k, x)| (int(k), int(x))).collect();
    let want = PyValue::Tuple(vec![
        PyValue::List(ints(&[1, 3, 5])),
        PyValue::Dict(pairs(&[(10, 11), (12, 13)])),
        PyValue::Dict(pairs(&[(20, 21), (22, 23)])),
        PyValue::List(vec![int(7), PyValue::Tuple(ints(&[8, 9]))]),
        PyValue::Set(ints(&[30, 31])),
        PyValue::Set(ints(&[32])),
        PyValue::Dict(pairs(&[(40, 41)])),
        PyValue::List(ints(&[42])),
        PyValue::Tuple(Vec::new()),
        PyValue::List(ints(&[2, 4])),
    ]);
    assert_eq!(parse(data).unwrap(), want);
    // The arena views see the same.
    let arena = parse_arena(data).unwrap();
    let items: Vec<PyRef<'_>> = arena.root().items().unwrap().collect();
    let l1: Vec<i64> = items[0]
        .items()
        .unwrap()
        .filter_map(|x| x.as_i64())
        .collect();
    assert_eq!(l1, [1, 3, 5]);
    let d2: Vec<(i64, i64)> = items[2]
        .dict_items()
        .unwrap()
        .filter_map(|(k, v)| Some((k.as_i64()?, v.as_i64()?)))
        .collect();
    assert_eq!(d2, [(20, 21), (22, 23)]);
    assert_eq!(items[3].type_name(), "list");
    assert_eq!(items[4].type_name(), "set");
    assert_eq!(items[8].items().unwrap().len(), 0);
}

#[test]
fn integers_at_the_edges_of_the_inline_range() {
    // pickle.dumps((2**60-1, 2**60, -2**60, -2**60-1, 2**63-1, -2**63, 1.5, True, False,
    //               None, 0, -1, 255, 65535, 2**31-1, -2**31), protocol=2)
    let data = b"\x80\x02(\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x0f\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x10\x8a\x08\x00\x00\x00\x00\x00\x00\x00\xf0\x8a\x08\xff\xff\xff\xff\xff\xff\xff\xef\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80G?\xf8\x00\x00\x00\x00\x00\x00\x88\x89NK\x00J\xff\xff\xff\xffK\xffM\xff\xffJ\xff\xff\xff\x7fJ\x00\x00\x00\x80tq\x00.";
    let ints: [i64; 6] = [
        (1 << 60) - 1,
        1 << 60,
        -(1 << 60),
        -(1 << 60) - 1,
        i64::MAX,
        i64::MIN,
    ];
    let mut want: Vec<PyValue> = ints.iter().map(|&i| PyValue::Int(i)).collect();
    want.extend([
        PyValue::Float(1.5),
        PyValue::Bool(true),
        PyValue::Bool(false),
        PyValue::None,
    ]);
    let small: [i64; 6] = [0, -1, 255, 65535, (1 << 31) - 1, -(1 << 31)];
    want.extend(small.iter().map(|&i| PyValue::Int(i)));
    assert_eq!(parse(data).unwrap(), PyValue::Tuple(want));
    let arena = parse_arena(data).unwrap();
    let items: Vec<PyRef<'_>> = arena.root().items().unwrap().collect();
    for (i, want) in ints.iter().enumerate() {
        assert_eq!(items[i].as_i64(), Some(*want), "item {i}");
        assert_eq!(items[i].type_name(), "int");
    }
    assert_eq!(items[6].as_i64(), None);
    assert_eq!(items[6].type_name(), "float");
    assert_eq!(items[7].as_i64(), Some(1));
    assert!(items[9].is_none() && !items[10].is_none());
    assert_eq!(items[11].as_i64(), Some(-1));
}

#[test]
fn memo_bomb_hits_the_node_limit() {
    // l0 = []; l_{i+1} = [l_i, l_i]: 2^40 nodes when expanded.
    let mut p = vec![0x80, 2, b']', b'q', 0, b'0'];
    for i in 0..40u8 {
        p.extend([b'h', i, b'h', i, 0x86, b'q', i + 1, b'0']);
    }
    p.extend([b'h', 40, b'.']);
    let err = parse(&p).unwrap_err();
    assert!(matches!(err, PickleError::Limit { .. }), "{err}");
}

#[test]
fn self_reference_hits_the_depth_limit() {
    // l = []; l.append(l)
    let p = [0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'];
    let err = parse(&p).unwrap_err();
    assert!(
        matches!(
            err,
            PickleError::Limit {
                what: "nesting depth",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn huge_length_is_truncation_not_allocation() {
    let p = [
        0x80, 4, 0x8d, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
    ];
    assert!(matches!(
        parse(&p).unwrap_err(),
        PickleError::Truncated { .. }
    ));
}

#[test]
fn protocol_six_is_refused() {
    assert!(matches!(
        parse(&[0x80, 6, b'N', b'.']).unwrap_err(),
        PickleError::UnsupportedProtocol { protocol: 6 }
    ));
}

#[test]
fn long1_sign_extends() {
    let p = [0x80, 2, 0x8a, 2, 0x00, 0xff, b'.'];
    assert_eq!(parse(&p).unwrap(), PyValue::Int(-256));
}
