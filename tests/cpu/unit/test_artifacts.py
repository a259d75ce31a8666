"""The compile cache's entries and keys (graphcomp/compiler/artifacts.py)."""

import warnings

import pytest
import torch
import torch.fx as fx

from graphcomp.compiler import artifacts


def _gm(scale: float = 2.0, const: torch.Tensor | None = None) -> fx.GraphModule:
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.arange(4.0) if const is None else const)

        def forward(self, x):
            return x * scale + self.c

    return fx.symbolic_trace(M())


def test_entry_round_trip(tmp_path):
    p = tmp_path / "k.gcart"
    artifacts.write_entry(p, "k" * 64, b"payload \x00\xff bytes")
    assert artifacts.read_entry(p, "k" * 64) == b"payload \x00\xff bytes"
    assert artifacts.read_entry(tmp_path / "absent.gcart", "k" * 64) is None
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file, renamed


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "other_key"])
def test_damaged_entry_is_ignored_with_a_warning(tmp_path, damage):
    p = tmp_path / "k.gcart"
    artifacts.write_entry(p, "k" * 64, bytes(range(256)) * 8)
    data = bytearray(p.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "garbage":
        data = bytearray(b"not an entry at all")
    p.write_bytes(bytes(data))
    key = "j" * 64 if damage == "other_key" else "k" * 64
    with pytest.warns(RuntimeWarning, match="ignoring the corrupt compile cache entry"):
        assert artifacts.read_entry(p, key) is None


def test_key_follows_graph_inputs_constants_config_and_world():
    x = [torch.randn(4)]
    base = artifacts.stage_key(_gm(), x, "uuid-a", 2, "fwd")
    assert artifacts.stage_key(_gm(), x, "uuid-a", 2, "fwd") == base  # deterministic
    changed = {
        "graph": artifacts.stage_key(_gm(scale=3.0), x, "uuid-a", 2, "fwd"),
        "constant": artifacts.stage_key(_gm(const=torch.arange(4.0) + 1), x, "uuid-a", 2, "fwd"),
        "input shape": artifacts.stage_key(_gm(), [torch.randn(5)], "uuid-a", 2, "fwd"),
        "input dtype": artifacts.stage_key(_gm(), [torch.randn(4, dtype=torch.float64)], "uuid-a", 2, "fwd"),
        "config or source": artifacts.stage_key(_gm(), x, "uuid-b", 2, "fwd"),
        "world size": artifacts.stage_key(_gm(), x, "uuid-a", 4, "fwd"),
        "stage": artifacts.stage_key(_gm(), x, "uuid-a", 2, "bwd"),
    }
    same = [what for what, k in changed.items() if k == base]
    assert not same, f"the key ignores: {same}"


def test_cache_uuid_ignores_fields_that_do_not_change_code():
    from graphcomp.compiler.backend import cache_uuid
    from graphcomp.config import Config

    a = cache_uuid(Config(), True)
    assert cache_uuid(Config(cache_dir="/x", compile_once=False, dump_dir="/d", rank_agreement_timeout=5.0), True) == a
    assert cache_uuid(Config(bucket_bytes=1), True) != a  # another config: another key, a cache miss
    assert cache_uuid(Config(), False) != a


def test_changed_source_changes_every_key(monkeypatch):
    from graphcomp.compiler import backend
    from graphcomp.config import Config

    a = backend.cache_uuid(Config(), True)
    monkeypatch.setattr(backend, "_source_digest", lambda: "another graphcomp")
    b = backend.cache_uuid(Config(), True)
    assert b != a
    x = [torch.randn(4)]
    assert artifacts.stage_key(_gm(), x, a, 2, "fwd") != artifacts.stage_key(_gm(), x, b, 2, "fwd")


def test_no_directory_and_one_rank_compile_as_before(monkeypatch):
    from graphcomp.config import Config

    monkeypatch.delenv("GRAPHCOMP_CACHE_DIR", raising=False)
    st = artifacts.StageArtifacts(Config(), rank=0, world_size=1, store_id="0/0/0/0")
    assert not st.active
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, rec = st.compile("fwd", _gm(), [torch.randn(4)], "u", lambda: "compiled-thing")
    assert out == "compiled-thing" and rec == {"source": "compiled"}


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    from graphcomp.config import Config

    monkeypatch.setenv("GRAPHCOMP_CACHE_DIR", str(tmp_path))
    assert artifacts.cache_dir(Config()) == tmp_path
    assert artifacts.cache_dir(Config(cache_dir=str(tmp_path / "mine"))) == tmp_path / "mine"


def test_cache_dir_moves_inductors_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from graphcomp import env

    monkeypatch.setattr(artifacts, "_INDUCTOR_DIR", [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/where/inductor/put/it")
    monkeypatch.setattr(env, "_INDUCTOR_CACHE_DIR_AT_IMPORT", None)
    artifacts.point_inductor_cache(tmp_path / "a")
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "a" / "inductor").resolve())
    artifacts.point_inductor_cache(tmp_path / "b")  # a second directory: the first stays
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "a" / "inductor").resolve())

    monkeypatch.setattr(artifacts, "_INDUCTOR_DIR", [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/users/choice")
    monkeypatch.setattr(env, "_INDUCTOR_CACHE_DIR_AT_IMPORT", "/users/choice")
    artifacts.point_inductor_cache(tmp_path / "c")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/users/choice"


def test_leaders_share_only_a_device_index():
    # CPU: rank 0 leads everyone
    assert artifacts.leader_of(4, None, 4) == (0, 3)
    # one machine of 8 GPUs: every rank leads itself, nothing to share (no waiting)
    assert artifacts.leader_of(8, 5, 8) == (5, 0)
    # two machines of 4 GPUs: rank 6 (device 2 of the second) loads rank 2's code
    assert artifacts.leader_of(8, 2, 4) == (2, 1)
    # no LOCAL_WORLD_SIZE: one machine assumed
    assert artifacts.leader_of(2, 1, None) == (1, 0)


def test_inspect_says_where_each_stage_graph_came_from():
    from graphcomp.tools.inspect_dumps import artifacts_text

    frame = {"stages": {"fwd": {"artifacts": {"source": "rank 0", "key": "abcd", "fx_graph_cache_hits": 1,
                                              "fx_graph_cache_misses": 0}},
                        "bwd": {"artifacts": {"source": "compiled"}},  # (no key: the feature was off)
                        "joint": {}}}
    assert artifacts_text(frame) == "fwd: rank 0 (key abcd, Inductor cache 1 hit(s), 0 miss(es))"
    assert artifacts_text({"stages": {}}) is None
