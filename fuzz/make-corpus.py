#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into fuzz/corpus/<target>/ (run from anywhere;
the files are committed). A seed's name says what settle must do with it, and
tests/offline/fuzz_corpus.rs checks exactly that on every test run:

  decode_upload/reject-<reason>-<n>   dead-lettered with <reason> (DecodeError::reason)
  decode_upload/apply-<name>          applied (decoded, run through the engine, ready records read back)
  config_toml/accept-<name>           loads; config_toml/reject-<name> is refused with a message
  trace_line/accept-<name>, trace_line/reject-<name>

Record layout (harness::Record::parse): flags byte (bit 0: no key; bits 2-3: policy),
timestamp i64 LE, wall clock u64 LE, key length byte, key, value.
"""
import json, os, pathlib, shutil, struct

here = pathlib.Path(__file__).resolve().parent
root = here.parent
WALL = 1_796_083_200_000  # 2026-12-01T00:00:00Z


def record(key, value, ts=WALL - 1000, wall=WALL, policy=0):
    flags = (1 if key is None else 0) | (policy & 3) << 2
    k = key or b""
    assert len(k) <= 255
    return bytes([flags]) + struct.pack("<qQ", ts, wall) + bytes([len(k)]) + k + value


def upload(session, extra="", tenant="h"):
    return f'{{"tenant":"{tenant}","session":{json.dumps(session)},"event_id":"e1"{extra}}}'.encode()


def nested(n):
    return '{"a":' * (n - 1) + "{}" + "}" * (n - 1)


K = b"h/s"
rejects = [
    (K, b"\xff\xfe", "invalid_utf8"),
    (K, b"{", "invalid_json"),
    (K, b'{"tenant":"h","session":"s","attributes":{"s":"\\ud800"}}', "invalid_json"),
    (K, b'{"tenant":"h","session":"s","attributes":{"k":1e999}}', "invalid_json"),
    (K, b"[]", "not_an_object"),
    (K, b'{"tenant":"h","tenant":"h","session":"s"}', "duplicate_field"),
    (K, b'{"session":"s"}', "missing_tenant"),
    (K, b'{"tenant":1,"session":"s"}', "tenant_not_string"),
    (b"/s", b'{"tenant":"","session":"s"}', "empty_tenant"),
    (K, ('{"tenant":"%s","session":"s"}' % ("t" * 129)).encode(), "tenant_too_long"),
    (b"a b/s", b'{"tenant":"a b","session":"s"}', "bad_tenant"),
    (K, b'{"tenant":"h"}', "missing_session"),
    (K, b'{"tenant":"h","session":[]}', "session_not_string"),
    (b"h/", b'{"tenant":"h","session":""}', "empty_session"),
    (K, ('{"tenant":"h","session":"%s"}' % ("s" * 300)).encode(), "session_too_long"),
    (b"h/\n", b'{"tenant":"h","session":"\\n"}', "session_control_char"),
    (K, b'{"tenant":"h","session":"s","event_id":7}', "event_id_not_string"),
    (K, ('{"tenant":"h","session":"s","event_id":"%s"}' % ("e" * 129)).encode(), "event_id_too_long"),
    (K, upload("s", ',"part":1'), "bad_part"),
    (K, upload("s", ',"part":{"index":1,"count":0}'), "part_count_zero"),
    (K, upload("s", ',"part":{"index":3,"count":2}'), "part_index_out_of_range"),
    (K, upload("s", ',"final":0'), "final_not_bool"),
    (K, upload("s", ',"attributes":[]'), "attributes_not_object"),
    (K, upload("s", ',"attributes":{"log":"%s"}' % ("x" * 17000)), "attributes_too_large"),
    (K, upload("s", ',"attributes":' + nested(65)), "attributes_too_deep"),
    # The poison record: 5 000 levels in 10 KB (arrays inside one object).
    (K, upload("s", ',"attributes":{"a":' + "[" * 4998 + "]" * 4998 + "}"), "attributes_too_deep"),
    (None, upload("s"), "missing_key"),
    (b"\xff", upload("s"), "key_not_utf8"),
    (b"h/t", upload("s"), "key_mismatch"),
]
applies = {
    "plain": (K, upload("s")),
    "deep-64": (K, upload("s", ',"attributes":' + nested(64))),
    "big-attributes": (K, upload("s", ',"attributes":{"log":"%s"}' % ("y" * 16000))),
    "escapes": (K, upload("s", r',"attributes":{"s":"\u2028\u2029\u0000\"\\\/\b\f\n\r\t","pair":"\ud83d\ude00","raw":"😀 ünï"}')),
    "numbers": (K, upload("s", ',"attributes":{"a":1e308,"b":-0,"c":123456789012345678901234567890,"d":[1.5e-300,true,null]}')),
    "unicode-session": ("h/a/b c/😀 ünï".encode(), upload("a/b c/😀 ünï")),
    "split": (K, upload("s", ',"part":{"index":1,"count":2},"final":null')),
    "final": (K, upload("s", ',"final":true,"attributes":{}')),
}
out = here / "corpus"
for target in ("decode_upload", "config_toml", "trace_line"):
    (out / target).mkdir(parents=True, exist_ok=True)
    # Generated seeds are rewritten; regress-* (inputs the fuzzer found) are kept.
    for old in (out / target).iterdir():
        if not old.name.startswith("regress-"):
            old.unlink()
seen = {}
for key, value, reason in rejects:
    n = seen[reason] = seen.get(reason, 0) + 1
    (out / "decode_upload" / f"reject-{reason}-{n}").write_bytes(record(key, value))
for i, (name, (key, value)) in enumerate(applies.items()):
    (out / "decode_upload" / f"apply-{name}").write_bytes(record(key, value, policy=i % 4))
# Timestamps a producer may set: none (-1), the epoch, far past, far future (capped at the wall clock).
for name, ts in {"ts-minus-one": -1, "ts-min": -(2**63), "ts-max": 2**63 - 1, "ts-zero": 0}.items():
    (out / "decode_upload" / f"apply-{name}").write_bytes(record(K, upload("s"), ts=ts, policy=2))

configs = {"accept-empty": ""}
configs["accept-settle-toml"] = (root / "config" / "settle.toml").read_text()
configs["accept-adaptive"] = '[debounce]\npolicy = "adaptive"\nmin-delay = "5s"\nmax-delay = "10m"\n'
configs["accept-tenants"] = (
    '[debounce]\ndelay = "30s"\nmax-wait = "10m"\n[debounce.tenants.acme]\npolicy = "leading-trailing"\n'
    '[debounce.tenants.noisy]\npolicy = "adaptive"\nmin-delay = "1s"\nmax-delay = "1h"\n'
    '[tiers]\nlimit = 50\nperiod = "20s"\n'
)
configs["accept-longest-delay"] = '[debounce]\ndelay = "365days"\nstate-ttl = "365days"\nmax-wait = "365days"\n'
configs["reject-too-long-delay"] = '[debounce]\ndelay = "100years"\n'
configs["reject-unknown-key"] = "[debounce]\ndelays = \"5s\"\n"
configs["reject-bad-duration"] = '[debounce]\ndelay = "5 parsecs"\n'
configs["reject-not-toml"] = "[debounce\n"
configs["reject-bad-policy"] = '[debounce]\npolicy = "sometimes"\n'
for name, text in configs.items():
    (out / "config_toml" / name).write_text(text)

lines = {
    "accept-ms": '{"ts":1764547200000,"tenant":"acme","session":"b1","event_id":"e1"}',
    "accept-rfc3339": '{"ts":"2026-12-01T00:00:00.123+09:00","tenant":"acme","session":"b1","partition":3,"part":{"index":1,"count":2}}',
    "accept-final": '{"ts":0,"tenant":"acme","session":"b1","final":true,"attributes":{"k":[1,2]}}',
    "reject-no-ts": '{"tenant":"acme","session":"b1"}',
    "reject-fraction": '{"ts":1.5,"tenant":"acme","session":"b1"}',
    "reject-bad-date": '{"ts":"2026-13-01T00:00:00Z","tenant":"acme","session":"b1"}',
    "reject-partition": '{"ts":1,"tenant":"acme","session":"b1","partition":-1}',
    "reject-not-json": "ts=1 tenant=acme",
}
for name, text in lines.items():
    (out / "trace_line" / name).write_text(text)
print(f"wrote {sum(1 for _ in out.rglob('*') if _.is_file())} seeds under {out}")
