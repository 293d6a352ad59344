"""`hotlora bench NAME` runs bench/NAME.py of a source checkout (the benchmarks are not installed
with the package) and, installed without one, says so instead of guessing a path."""

import sys

import hotlora
from hotlora.cli import main, source_checkout


def test_an_installed_package_without_a_checkout_says_where_benchmarks_live(tmp_path, monkeypatch, capsys):
    installed = tmp_path / "lib" / "python3" / "site-packages" / "hotlora" / "__init__.py"
    monkeypatch.setattr(hotlora, "__file__", str(installed))
    monkeypatch.chdir(tmp_path)
    assert source_checkout() is None
    assert main(["bench", "swap"]) == 2
    error = capsys.readouterr().err
    assert "no source checkout" in error and "not installed with the package" in error and "--repo" in error


def test_a_checkout_is_found_from_its_folder_or_given_and_its_script_run(tmp_path, monkeypatch, capsys):
    checkout = tmp_path / "clone"
    (checkout / "bench").mkdir(parents=True)
    (checkout / "bench" / "harness.py").write_text("")
    (checkout / "bench" / "hello.py").write_text("import sys\nprint('hello', sys.argv[1:])\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cmd_bench hands the script its own argv
    assert main(["bench", "--repo", str(checkout), "hello", "--runs", "2"]) == 0
    assert capsys.readouterr().out == "hello ['--runs', '2']\n"
    monkeypatch.chdir(checkout)
    assert source_checkout() == checkout
    assert main(["bench", "nothing"]) == 2
    assert "no benchmark 'nothing'" in capsys.readouterr().err


def test_this_checkout_is_found_from_an_editable_install(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = source_checkout()
    assert found is not None and (found / "bench" / "swap.py").is_file()
