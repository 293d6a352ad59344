"""Inductor's precompiled C++ header is built in the temp dir, new in each container: kept with the
compile artifacts after a warm-up and copied back before compiling, only ever whole (g++ refuses a
header cut short, and fails every kernel's compile)."""

import shutil
import subprocess

import pytest

from hotlora.engine.pipeline import KEPT_HEADERS, keep_compiler_headers, restore_compiler_headers


def built(live, name="k1", size=1000):
    live.mkdir(exist_ok=True)
    (live / f"{name}.h").write_text("#include <torch/csrc/inductor/cpp_prefix.h>\n")
    (live / f"{name}.h.gch").write_bytes(b"g" * size)


def test_a_header_kept_after_warm_up_is_back_in_a_new_temp_dir(tmp_path):
    cache, first = tmp_path / "compile", tmp_path / "tmp-first"
    built(first)
    assert keep_compiler_headers(cache, first) == ["k1.h.gch"]
    assert keep_compiler_headers(cache, first) == []  # kept once

    fresh = tmp_path / "tmp-restarted"  # the next container's /tmp
    assert restore_compiler_headers(cache, fresh) == ["k1.h", "k1.h.gch"]
    assert (fresh / "k1.h.gch").read_bytes() == b"g" * 1000
    assert restore_compiler_headers(cache, fresh) == []  # never over a header that is there


def test_a_kept_header_cut_short_is_never_copied(tmp_path):
    cache, first, fresh = tmp_path / "compile", tmp_path / "tmp-first", tmp_path / "tmp-restarted"
    built(first)
    keep_compiler_headers(cache, first)
    kept = cache / KEPT_HEADERS / "k1.h.gch"
    kept.write_bytes(kept.read_bytes()[:400])  # as a kill mid-copy would leave it, were it not renamed whole
    assert restore_compiler_headers(cache, fresh) == ["k1.h"]
    assert not (fresh / "k1.h.gch").exists() and not kept.exists()  # inductor builds it; the bad copy is gone
    assert restore_compiler_headers(tmp_path / "nothing-kept", fresh) == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ (the image and CI have one)")
def test_gcc_refuses_a_precompiled_header_cut_short(tmp_path):
    """Why a header is only ever copied whole: g++ does not fall back to the source of a truncated .gch."""
    (tmp_path / "h.h").write_text("inline int three() { return 3; }\n")
    subprocess.run(["g++", "-x", "c++-header", "h.h", "-o", "h.h.gch"], cwd=tmp_path, check=True, timeout=120)
    data = (tmp_path / "h.h.gch").read_bytes()
    (tmp_path / "h.h.gch").write_bytes(data[: len(data) // 2])
    (tmp_path / "m.cpp").write_text('#include "h.h"\nint main() { return three() - 3; }\n')
    done = subprocess.run(["g++", "m.cpp", "-o", "m"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "PCH" in done.stderr


def test_a_kept_header_another_user_could_have_written_is_not_copied(tmp_path):
    cache, first, fresh = tmp_path / "compile", tmp_path / "tmp-first", tmp_path / "tmp-restarted"
    built(first)
    keep_compiler_headers(cache, first)
    (cache / KEPT_HEADERS).chmod(0o777)  # g++ would load whatever another user put there
    assert restore_compiler_headers(cache, fresh) == []
