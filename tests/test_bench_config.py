"""flare bench configurations: parsing, defaults, and errors that name the file and the key."""
from __future__ import annotations

from pathlib import Path

import pytest

import flare.plugins.bench.testing

flare.plugins.bench.testing.register()   # the bench-fake workload
from flare.plugins.bench import BenchConfigError, check_pair, load_config, parse_config

BACKENDS = ["cpu", "vulkan"]


def write(tmp_path: Path, text: str, name: str = "a.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str, name: str = "a.toml"):
    return load_config(write(tmp_path, text, name), known_backends=BACKENDS)


def error(tmp_path: Path, text: str, name: str = "a.toml") -> BenchConfigError:
    with pytest.raises(BenchConfigError) as info:
        load(tmp_path, text, name)
    return info.value


def test_defaults_are_filled_and_name_is_the_stem(tmp_path):
    cfg = load(tmp_path, 'model = "bench-fake"\n', "mine.toml")
    assert cfg.name == "mine" and cfg.model == "bench-fake" and cfg.backends == ("cpu",)
    assert cfg.peer == "flare" and cfg.prepared is True and cfg.workspace_sharing is True
    assert cfg.options == {"scale": 1.0, "drift": 0.0, "items": 2, "mode": "fast", "files": ("builtin",)}
    assert cfg.to_json()["options"]["files"] == ["builtin"]


def test_every_key_is_read(tmp_path):
    (tmp_path / "data.txt").write_text("x\n")
    cfg = load(tmp_path, """
name = "b"
description = "all keys"
model = "bench-fake"
backends = ["vulkan", "cpu:1"]
prepared = false
workspace_sharing = false
[options]
scale = 2          # an int where a float is expected is fine
mode = "slow"
files = ["data.txt", "builtin"]
""")
    assert cfg.backends == ("vulkan", "cpu:1") and not cfg.prepared and not cfg.workspace_sharing
    assert cfg.options["scale"] == 2.0 and cfg.options["mode"] == "slow"
    assert cfg.options["files"] == (str((tmp_path / "data.txt").resolve()), "builtin")


@pytest.mark.parametrize("text, key, words", [
    ('model = "bench-fake"\nbackend = ["cpu"]\n', "backend", "did you mean 'backends'"),
    ('model = "bench-fake"\n[options]\nscal = 2.0\n', "options.scal", "did you mean 'scale'"),
    ('model = "bench-fake"\nprepared = "yes"\n', "prepared", "must be a boolean"),
    ('model = "bench-fake"\n[options]\nitems = 1.5\n', "options.items", "must be an integer"),
    ('model = "bench-fake"\n[options]\nitems = 0\n', "options.items", "at least 1"),
    ('model = "bench-fake"\n[options]\nmode = "warp"\n', "options.mode", "one of fast, slow"),
    ('model = "bench-fake"\noptions = 3\n', "options", "must be a table"),
    ('model = "no-such-model"\n', "model", "unknown model 'no-such-model'"),
    ('name = "x"\n', "model", "missing"),
    ('model = "bench-fake"\nbackends = ["cuda"]\n', "backends", "unknown backend 'cuda'"),
    ('model = "bench-fake"\nbackends = []\n', "backends", "non-empty list"),
    ('model = "bench-fake"\npeer = "tensorflow"\n', "peer", "no peer 'tensorflow'"),
    ('model = "bench-fake"\npeer = "missing"\n', "peer", "'no_such_module_x', which is not importable"),
    ('model = "bench-fake"\npeer = "other"\nbackends = ["vulkan"]\n', "backends", "CPU only"),
    ('model = "bench-fake"\npeer = "other"\nprepared = false\n', "prepared", "flare peer only"),
    ('model = "bench-fake"\n[options]\nfiles = ["nope.wav"]\n', "options.files", "does not exist"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, key, words):
    err = error(tmp_path, text)
    assert err.key == key and err.path == tmp_path / "a.toml"
    assert str(err).startswith(f"{tmp_path / 'a.toml'}: key {key!r}: ")
    assert words in str(err)


def test_known_models_are_listed_in_the_error(tmp_path):
    msg = str(error(tmp_path, 'model = "silero"\n'))
    assert "silero-vad" in msg and "minilm-l6" in msg and "moe-lm" in msg


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(BenchConfigError, match="no such configuration file") as info:
        load_config(tmp_path / "absent.toml")
    assert info.value.path == tmp_path / "absent.toml" and info.value.key is None
    err = error(tmp_path, 'model = "bench-fake\n')
    assert "not valid TOML" in str(err) and str(tmp_path / "a.toml") in str(err)


def test_unshared_workspace_refused_where_entries_share_state(tmp_path):
    err = error(tmp_path, 'model = "moe-lm"\nworkspace_sharing = false\n')
    assert err.key == "workspace_sharing" and "share state" in str(err)


def test_real_workloads_validate_their_options(tmp_path):
    assert load(tmp_path, 'model = "silero-vad"\n[options]\nmode = "streaming"\n').options["audio"] == ("sample",)
    err = error(tmp_path, 'model = "minilm-l6"\n[options]\nmax_length = 600\n')
    assert err.key == "options.max_length"
    err = error(tmp_path, 'model = "silero-vad"\npeer = "torch"\n')
    assert err.key == "peer"


def test_pair_must_share_model_and_request_options(tmp_path):
    a = load(tmp_path, 'model = "bench-fake"\n[options]\nitems = 2\nscale = 1.0\n', "a.toml")
    b = load(tmp_path, 'model = "bench-fake"\npeer = "other"\n[options]\nitems = 2\nscale = 3.0\n', "b.toml")
    assert check_pair(a, b).model == "bench-fake"        # scale may differ: it does not shape requests
    c = load(tmp_path, 'model = "bench-fake"\n[options]\nitems = 5\n', "c.toml")
    with pytest.raises(BenchConfigError, match="A and B must agree") as info:
        check_pair(a, c)
    assert info.value.key == "options.items" and "c.toml" in str(info.value)
    d = parse_config({"model": "silero-vad"}, name="d", known_backends=BACKENDS)
    with pytest.raises(BenchConfigError, match="one model"):
        check_pair(a, d)


def test_an_unusable_backend_is_named_before_anything_runs(tmp_path):
    from flare.plugins.bench.config import check_usable
    from flare.core.plugin_manager import get_plugin_manager

    spec = get_plugin_manager().backends().get("cuda")
    if spec is None or spec.backend.probe().usable:
        pytest.skip("needs an installed CUDA backend that cannot run here")
    cfg = load_config(write(tmp_path, 'model = "bench-fake"\nbackends = ["cuda", "cpu"]\n'))
    with pytest.raises(BenchConfigError, match="backend 'cuda' cannot run here") as info:
        check_usable(cfg)
    assert info.value.key == "backends" and info.value.path == tmp_path / "a.toml"
    check_usable(load_config(write(tmp_path, 'model = "bench-fake"\n', "b.toml")))


def test_threads_sets_the_flare_cpu_device_and_the_peers_option(tmp_path):
    cfg = load(tmp_path, 'model = "silero-vad"\nthreads = 2\n')
    assert cfg.threads == 2 and cfg.cpu_config() == {"cpu": {"threads": 2}} and cfg.to_json()["threads"] == 2
    assert load(tmp_path, 'model = "silero-vad"\n').cpu_config() == {}
    ort = load(tmp_path, 'model = "minilm-l6"\npeer = "onnxruntime"\nthreads = 3\n')
    assert ort.options["threads"] == 3            # onnxruntime's intra-op threads follow the top-level key
    old = load(tmp_path, 'model = "minilm-l6"\npeer = "onnxruntime"\n[options]\nthreads = 2\n')
    assert old.options["threads"] == 2 and old.threads is None    # the older spelling still works


@pytest.mark.parametrize("text, key, words", [
    ('model = "silero-vad"\nthreads = 0\n', "threads", "between 1 and 4096"),
    ('model = "silero-vad"\nthreads = "2"\n', "threads", "must be an integer"),
    ('model = "silero-vad"\npeer = "numpy"\nthreads = 2\n', "threads", "does not take a thread count"),
    ('model = "minilm-l6"\npeer = "onnxruntime"\nthreads = 2\n[options]\nthreads = 1\n', "options.threads", "keep one"),
])
def test_threads_errors_name_the_key(tmp_path, text, key, words):
    err = error(tmp_path, text)
    assert err.key == key and words in str(err)


def test_every_shipped_cpu_config_says_its_threads():
    root = Path(__file__).resolve().parent.parent / "bench" / "configs"
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    for path in sorted(root.glob("*.toml")):
        if tomllib.loads(path.read_text()).get("model") not in ("silero-vad", "minilm-l6", "moe-lm"):
            continue   # other models' configs may name peers not installed here (llama.cpp)
        cfg = load_config(path, known_backends=BACKENDS)
        if cfg.model in ("silero-vad", "minilm-l6", "moe-lm") and cfg.peer in ("flare", "onnxruntime") \
                and cfg.backends == ("cpu",):
            assert cfg.threads in (1, 2), path.name
