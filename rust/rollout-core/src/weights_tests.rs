use super::*;

fn v(version: &str, path: Option<&str>, checksum: Option<&str>) -> WeightVersion {
    WeightVersion {
        version: version.into(),
        path: path.map(String::from),
        checksum: checksum.map(String::from),
        published_seq: 1,
    }
}

#[test]
fn engine_update_edge_table() {
    use EngineUpdateEvent as E;
    use EngineUpdateStatus as S;
    let table = [
        (S::Pending, E::Start, Some(S::Updating)),
        (S::Pending, E::Verified, Some(S::Verified)),
        (S::Updating, E::Verified, Some(S::Verified)),
        (S::Pending, E::Fail, Some(S::Failed)),
        (S::Updating, E::Fail, Some(S::Failed)),
        (S::Pending, E::Skip, Some(S::Skipped)),
        // Illegal: terminal states stay terminal; an engine cannot start twice.
        (S::Updating, E::Start, None),
        (S::Updating, E::Skip, None),
        (S::Verified, E::Fail, None),
        (S::Verified, E::Start, None),
        (S::Failed, E::Verified, None),
        (S::Skipped, E::Start, None),
    ];
    for (from, event, expected) in table {
        assert_eq!(from.on(event).ok(), expected, "{from:?} --{event:?}-->");
    }
    for s in [S::Verified, S::Failed, S::Skipped] {
        assert!(s.is_terminal());
    }
}

#[test]
fn update_edge_table() {
    use WeightUpdateEvent as E;
    use WeightUpdateStatus as S;
    let table = [
        (S::Pending, E::Start, Some(S::Updating)),
        (S::Updating, E::Commit, Some(S::Completed)),
        (S::Pending, E::Fail, Some(S::Failed)),
        (S::Updating, E::Fail, Some(S::Failed)),
        (S::Pending, E::Commit, None),
        (S::Completed, E::Fail, None),
        (S::Failed, E::Commit, None),
        (S::Completed, E::Start, None),
    ];
    for (from, event, expected) in table {
        assert_eq!(from.on(event).ok(), expected, "{from:?} --{event:?}-->");
    }
    let err = S::Completed.on(E::Fail).unwrap_err().to_string();
    assert!(err.contains("Completed") && err.contains("Fail"), "{err}");
}

#[test]
fn wave_sizes() {
    use UpdateStrategy::*;
    let table = [
        (AllAtOnce, None, 6, 6),
        (AllAtOnce, Some(1), 6, 6),
        (Rolling, None, 1, 1),
        (Rolling, None, 3, 1),
        (Rolling, None, 8, 2),
        (Rolling, None, 16, 4),
        (Rolling, Some(1), 16, 1),
        (Rolling, Some(3), 16, 3),
        (Rolling, Some(40), 16, 16),
        (Rolling, Some(0), 16, 1),
        (Rolling, None, 0, 1),
    ];
    for (strategy, max, fleet, want) in table {
        assert_eq!(wave_size(strategy, max, fleet), want, "{strategy} max={max:?} fleet={fleet}");
    }
}

#[test]
fn next_wave_takes_serving_engines_off_target_in_order() {
    let e = |id: &str, serving: bool, on_target: bool| EngineView {
        engine_id: crate::ids::EngineId::parse(id).unwrap(),
        serving,
        on_target,
    };
    let engines =
        [e("a", true, true), e("b", true, false), e("c", false, false), e("d", true, false), e("f", true, false)];
    assert_eq!(next_wave(&engines, 2), vec!["b", "d"]);
    assert_eq!(next_wave(&engines, 10), vec!["b", "d", "f"]);
    assert!(next_wave(&[e("a", true, true), e("c", false, false)], 4).is_empty());
}

#[test]
fn served_by_compares_version_and_checksum_when_both_known() {
    let want = v("v2", Some("/ck"), Some("abc"));
    assert!(want.served_by(Some("v2"), Some("abc")));
    assert!(want.served_by(Some("v2"), None), "real SGLang reports no checksum");
    assert!(!want.served_by(Some("v2"), Some("abd")));
    assert!(!want.served_by(Some("v1"), Some("abc")));
    assert!(!want.served_by(None, Some("abc")));
    assert!(WeightVersion::startup("v0").served_by(Some("v0"), Some("anything")));
}

#[test]
fn publish_checks() {
    let known = [WeightVersion::startup("v0"), v("v1", Some("/a"), Some("c1"))];
    assert_eq!(check_publish(&known, "v2", "/b", Some("c2")), PublishCheck::New);
    assert_eq!(check_publish(&known, "v2", "/b", None), PublishCheck::New);
    assert_eq!(check_publish(&known, "v1", "/a", Some("c1")), PublishCheck::Same);
    assert_eq!(check_publish(&known, "v1", "/a", None), PublishCheck::Same, "same path, no checksum given");
    let PublishCheck::Conflict(why) = check_publish(&known, "v1", "/a", Some("c9")) else { panic!() };
    assert!(why.contains("c1") && why.contains("c9"), "{why}");
    assert!(matches!(check_publish(&known, "v1", "/other", Some("c1")), PublishCheck::Conflict(_)));
    assert!(matches!(check_publish(&known, "v1", "/other", None), PublishCheck::Conflict(_)));
    assert!(matches!(check_publish(&known, "v0", "/a", Some("c1")), PublishCheck::Conflict(_)));
    assert!(matches!(check_publish(&known, "v0", "/a", None), PublishCheck::Conflict(_)));
    // A version still being hashed (checksum unknown) with the same path is the same publish.
    let hashing = [v("v3", Some("/c"), None)];
    assert_eq!(check_publish(&hashing, "v3", "/c", Some("c3")), PublishCheck::Same);
}

#[test]
fn file_hash_is_sha256_of_its_bytes() {
    let mut c = FileHash::default();
    c.update(b"ab");
    c.update(b"c");
    // SHA-256("abc")
    assert_eq!(c.finish(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

#[test]
fn checkpoint_checksum_is_sha256_of_the_sha256sum_listing() {
    let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    let empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    // printf 'abc' > b.safetensors; : > a.safetensors; sha256sum a.safetensors b.safetensors | sha256sum
    let listing = format!("{empty}  a.safetensors\n{abc}  b.safetensors\n");
    let mut want = FileHash::default();
    want.update(listing.as_bytes());
    let want = want.finish();
    assert_eq!(want, "2103dfed16ee882912fdd1827dbb1fc64af654ff953db30022957e1cddd155d7", "what coreutils prints");
    assert_eq!(checkpoint_checksum([("a.safetensors", empty), ("b.safetensors", abc)]), want);
    // Order of the input does not matter; names and digests do.
    assert_eq!(checkpoint_checksum([("b.safetensors", abc), ("a.safetensors", empty)]), want);
    assert_ne!(checkpoint_checksum([("a.safetensors", abc), ("b.safetensors", empty)]), want);
    assert_ne!(checkpoint_checksum([("c.safetensors", empty), ("b.safetensors", abc)]), want);
    // Byte-wise order: upper case sorts before lower case.
    let upper_first = format!("{abc}  B.safetensors\n{empty}  a.safetensors\n");
    let mut h = FileHash::default();
    h.update(upper_first.as_bytes());
    assert_eq!(checkpoint_checksum([("a.safetensors", empty), ("B.safetensors", abc)]), h.finish());
}

#[test]
fn update_status_machine() {
    use WeightUpdateEvent as E;
    use WeightUpdateStatus as S;
    assert_eq!(S::Checksumming.on(E::Checksummed), Ok(S::Pending));
    assert_eq!(S::Checksumming.on(E::Fail), Ok(S::Failed));
    assert!(S::Checksumming.on(E::Start).is_err(), "nothing loads before the checksum is known");
    assert!(S::Checksumming.on(E::Commit).is_err());
    assert!(S::Pending.on(E::Checksummed).is_err());
    assert!(!S::Checksumming.is_terminal());
    assert_eq!(S::Checksumming.to_string(), "CHECKSUMMING");
    assert_eq!(serde_json::to_value(S::Checksumming).unwrap(), "CHECKSUMMING");
}

#[test]
fn safetensors_headers() {
    let ok = br#"{"__metadata__":{"a":"b"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    assert_eq!(safetensors_header(ok, 8), Ok(1));
    assert!(safetensors_header(ok, 4).is_err(), "offsets beyond the data");
    assert!(safetensors_header(b"not json", 8).is_err());
    assert!(safetensors_header(b"[1]", 8).is_err());
    assert!(safetensors_header(br#"{"w":{"dtype":"F32","data_offsets":[0,8]}}"#, 8).is_err());
    assert_eq!(safetensors_header_len(10u64.to_le_bytes(), 30), Ok(10));
    assert!(safetensors_header_len(10u64.to_le_bytes(), 12).is_err());
    assert!(safetensors_header_len(0u64.to_le_bytes(), 12).is_err());
    assert!(safetensors_header_len([0; 8], 4).is_err());
}

#[test]
fn every_edge_of_the_weight_machines() {
    use EngineUpdateEvent as EE;
    use EngineUpdateStatus as ES;
    use WeightUpdateEvent as WE;
    use WeightUpdateStatus as WS;
    // Every pair of (state, event): exactly these move the machine, to these states.
    let engine_legal = [
        (ES::Pending, EE::Start, ES::Updating),
        (ES::Pending, EE::Verified, ES::Verified),
        (ES::Pending, EE::Fail, ES::Failed),
        (ES::Pending, EE::Skip, ES::Skipped),
        (ES::Updating, EE::Verified, ES::Verified),
        (ES::Updating, EE::Fail, ES::Failed),
    ];
    for s in [ES::Pending, ES::Updating, ES::Verified, ES::Failed, ES::Skipped] {
        for e in [EE::Start, EE::Verified, EE::Fail, EE::Skip] {
            let want = engine_legal.iter().find(|(from, ev, _)| *from == s && *ev == e).map(|(_, _, to)| *to);
            assert_eq!(s.on(e).ok(), want, "engine update {s:?} --{e:?}-->");
        }
    }
    let update_legal = [
        (WS::Checksumming, WE::Checksummed, WS::Pending),
        (WS::Checksumming, WE::Fail, WS::Failed),
        (WS::Pending, WE::Start, WS::Updating),
        (WS::Pending, WE::Fail, WS::Failed),
        (WS::Updating, WE::Commit, WS::Completed),
        (WS::Updating, WE::Fail, WS::Failed),
    ];
    for s in [WS::Checksumming, WS::Pending, WS::Updating, WS::Completed, WS::Failed] {
        for e in [WE::Checksummed, WE::Start, WE::Commit, WE::Fail] {
            let want = update_legal.iter().find(|(from, ev, _)| *from == s && *ev == e).map(|(_, _, to)| *to);
            assert_eq!(s.on(e).ok(), want, "update {s:?} --{e:?}-->");
        }
    }
}

#[test]
fn pause_modes_are_sglangs_three() {
    for (name, known) in
        [("abort", true), ("retract", true), ("in_place", true), ("in-place", false), ("Abort", false), ("", false)]
    {
        assert_eq!(crate::weights::PauseMode::known(name), known, "{name:?}");
    }
}

#[test]
fn group_backends_are_nccl_and_gloo() {
    use crate::weights::GroupBackend;
    for (name, want) in [("nccl", Some(GroupBackend::Nccl)), ("gloo", Some(GroupBackend::Gloo))] {
        assert_eq!(GroupBackend::parse(name).ok(), want);
        assert_eq!(want.map(GroupBackend::name), Some(name));
    }
    for name in ["NCCL", "mpi", "", "gloo "] {
        let err = GroupBackend::parse(name).expect_err(name);
        assert!(err.contains("\"nccl\"") && err.contains("\"gloo\""), "{err}");
    }
    assert_eq!(GroupBackend::default(), GroupBackend::Nccl);
    // On the wire and in the store, by its name.
    assert_eq!(serde_json::from_str::<GroupBackend>("\"gloo\"").ok(), Some(GroupBackend::Gloo));
}
