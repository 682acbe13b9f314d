"""What the ranks of a run compare before training (`dilocox.agreement`): the settings they must share, a fingerprint
of the payload key that tells keys apart without revealing them, and a message that names each difference."""

import hashlib
import hmac
import json
import shutil

import pytest

from dilocox.agreement import describe_differences, differing_settings, run_settings, settings_fingerprint
from dilocox.config import load_config
from dilocox.data.prepare import prepare_dataset
from dilocox.net.auth import PayloadAuth
from tests.e2e.helpers import DEBUG

KEY = b"the shared key of every cluster!"


def settings(*flags: str) -> dict:
    return run_settings(load_config(DEBUG, list(flags)))


def test_a_differing_setting_is_named_with_its_values_and_the_ranks_and_nodes_that_hold_them():
    same, other = settings(), settings("--train.lr=0.03", "--sync.outer.lr=1.5")
    message = describe_differences([same, same, other], nodes=["0", "0", "1"])
    assert message == (
        "train.lr: 0.003 on ranks 0-1 (node 0), 0.03 on rank 2 (node 1); "
        "sync.outer.lr: 0.7 on ranks 0-1 (node 0), 1.5 on rank 2 (node 1)"
    )
    assert describe_differences([same, same, same]) == ""
    assert settings_fingerprint(same) != settings_fingerprint(other)


def test_another_codec_is_a_differing_setting():
    int4, lowrank = settings("--compression.kind=int4"), settings("--compression.kind=lowrank")
    assert describe_differences([int4, lowrank]).startswith('compression.kind: "int4" on rank 0, "lowrank" on rank 1')


def test_what_may_differ_between_machines_is_not_compared(tmp_path):
    for copy in ("a", "b"):
        (tmp_path / copy).mkdir()
        (tmp_path / copy / "corpus.txt").write_text("to be or not to be\n" * 2000)
    there = settings(f"--data.path={tmp_path / 'a'}")
    here = settings(f"--data.path={tmp_path / 'b'}", "--run.num_threads=2", "--network.bandwidth=10Mbps")
    assert differing_settings([there, here]) == []


def test_what_the_data_and_the_tokenizer_hold_is_compared_wherever_they_are(tmp_path):
    text = "to be or not to be\n" * 20_000  # 380 kB: more than the blocks sampled
    paths = [tmp_path / name for name in ("a.txt", "b.txt", "c.txt")]
    paths[0].write_text(text)
    paths[1].write_text(text)
    paths[2].write_text(text[:250_000] + "TO" + text[250_002:])  # the same size, two letters changed (sampled)
    described = [settings(f"--data.path={path}") for path in paths]
    assert differing_settings(described[:2]) == []
    assert differing_settings([described[0], described[2]]) == ["data.path"]
    assert differing_settings([described[0], settings()]) == ["data.path"]  # the default corpus
    assert described[0]["data.path"].startswith("content ") and described[0]["data.tokenizer"] is None


def test_a_static_run_also_compares_what_its_ranks_do_together_an_elastic_one_does_not():
    assert differing_settings([settings(), settings("--checkpoint.interval=30")]) == ["checkpoint.interval"]
    elastic = ["--topology.elastic=true", "--preset=dilocox-lowrank", "--sync.merge=eager"]
    elastic += ["--sync.local_residual=false", "--sync.drain_residual=false"]
    assert differing_settings([settings(*elastic), settings(*elastic, "--checkpoint.interval=30")]) == []


def test_the_key_is_compared_by_a_fingerprint_that_reveals_nothing_of_it(tmp_path):
    paths = [tmp_path / name for name in ("a.key", "b.key", "c.key")]
    paths[0].write_bytes(KEY)
    paths[1].write_bytes(KEY + b"\n")  # the same key (a trailing newline is not part of it), at another path
    paths[2].write_bytes(KEY[::-1])
    codec = "--compression.kind=int4"
    keyed = [settings(codec, f"--network.auth_key_file={path}") for path in paths]
    assert differing_settings(keyed[:2]) == []
    assert differing_settings([keyed[0], keyed[2]]) == ["network.auth_key_file"]
    assert differing_settings([keyed[0], settings(codec)]) == ["network.auth_key_file"]
    fingerprint = PayloadAuth(KEY).fingerprint()
    assert keyed[0]["network.auth_key_file"] == f"key {fingerprint}" and len(fingerprint) == 16
    # an HMAC under the key: no plain hash of the key, and nothing of the key in what the ranks exchange
    assert fingerprint not in (
        hashlib.sha256(KEY).hexdigest(),
        hashlib.sha1(KEY).hexdigest(),
        hashlib.md5(KEY).hexdigest(),
    )
    assert fingerprint == hmac.new(KEY, b"dilocox/auth-key-fingerprint/v1\x00", hashlib.sha256).hexdigest()[:16]
    exchanged = json.dumps(keyed[0])
    assert KEY.decode() not in exchanged and KEY.hex() not in exchanged
    assert (
        describe_differences([keyed[0], settings(codec)])
        == f"network.auth_key_file: key {fingerprint} on rank 0, none on rank 1"
    )


def test_an_unreadable_key_file_is_the_key_files_own_error(tmp_path):
    with pytest.raises(ValueError, match="network.auth_key_file = .*missing.key: no such file"):
        settings(f"--network.auth_key_file={tmp_path / 'missing.key'}")


def test_many_differences_are_counted_beyond_the_first_six():
    base = settings()
    other = {**base, **{name: "x" for name in list(base)[:9]}}
    message = describe_differences([base, other])
    assert message.count(" on rank 0, ") == 6 and message.endswith("; and 3 more")


def test_a_prepared_directory_is_compared_by_what_its_index_and_files_hold(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("".join(f"line {i} of the king and the queen\n" for i in range(3000)))
    prepare_dataset(str(tmp_path / "corpus"), tmp_path / "prepared", vocab_size=300)
    prepare_dataset(str(tmp_path / "corpus"), tmp_path / "other", vocab_size=290)  # another tokenizer, other ids
    shutil.copytree(tmp_path / "prepared", tmp_path / "copy")
    described = [settings(f"--data.path={tmp_path / name}") for name in ("prepared", "copy", "other")]
    assert differing_settings(described[:2]) == []
    assert differing_settings([described[0], described[2]]) == ["data.path"]
