"""Inductor's precompiled C++ headers outlive the process (a host's /tmp, the image's compile volume):
a header a kill cut short must never reach g++, which refuses it and fails every kernel's compile."""

import shutil
import subprocess

import pytest

from hotlora.engine.pipeline import WHOLE_HEADERS, drop_unfinished_headers, record_whole_headers


def test_only_headers_a_finished_warm_up_recorded_are_kept(tmp_path):
    (tmp_path / "whole.h.gch").write_bytes(b"w" * 1000)
    (tmp_path / "rebuilt.h.gch").write_bytes(b"r" * 1000)
    record_whole_headers(tmp_path)
    assert (tmp_path / WHOLE_HEADERS).is_file()
    assert drop_unfinished_headers(tmp_path) == []  # a restart keeps what the warm-up used

    (tmp_path / "rebuilt.h.gch").write_bytes(b"r" * 400)  # cut short by a kill while it was built again
    (tmp_path / "new.h.gch").write_bytes(b"n" * 1000)  # built by a start killed before its warm-up ended
    (tmp_path / "new.h").write_text("#include <vector>\n")  # its source, which g++ reads without it
    assert drop_unfinished_headers(tmp_path) == ["new.h.gch", "rebuilt.h.gch"]
    assert sorted(p.name for p in tmp_path.glob("*.gch")) == ["whole.h.gch"]
    assert (tmp_path / "new.h").is_file()  # only .gch files are judged
    assert drop_unfinished_headers(tmp_path / "absent") == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ (the image and CI have one)")
def test_gcc_refuses_a_precompiled_header_cut_short(tmp_path):
    """Why the above exists: g++ does not fall back to the header's source for a truncated .gch."""
    (tmp_path / "h.h").write_text("inline int three() { return 3; }\n")
    subprocess.run(["g++", "-x", "c++-header", "h.h", "-o", "h.h.gch"], cwd=tmp_path, check=True, timeout=120)
    data = (tmp_path / "h.h.gch").read_bytes()
    (tmp_path / "h.h.gch").write_bytes(data[: len(data) // 2])
    (tmp_path / "m.cpp").write_text('#include "h.h"\nint main() { return three() - 3; }\n')
    done = subprocess.run(["g++", "m.cpp", "-o", "m"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "PCH" in done.stderr
    drop_unfinished_headers(tmp_path)  # no record: the header is dropped, and g++ reads the source
    subprocess.run(["g++", "m.cpp", "-o", "m"], cwd=tmp_path, check=True, timeout=120)
