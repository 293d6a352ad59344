"""bench/device_deps.py and bench/device_env.py: what travels to the lent GPU machine, derived from
declared requirements, and the import check that stops a run there before any GPU time."""

import io
import json
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench import device_deps, device_env
from bench.device_deps import Item, install_list, project_requirements, read_image, resolve, wheel_fits

REPO = Path(__file__).resolve().parents[2]


class FakeFile:
    def __init__(self, size):
        self.size = size


class FakeDist:
    def __init__(self, version, requires=(), size=1000):
        self.version, self.requires, self.files = version, list(requires), [FakeFile(size)]


def fake_venv(dists):
    return lambda name: dists.get(name)


def needed(items):
    return {i.name: i for i in items if i.tier == "needed"}


def test_resolve_follows_requirements_markers_extras_and_the_image():
    dists = {
        "pkg-a": FakeDist("1.0", ["pkg-b>=2", "shared", "only-in-x; extra == 'x'", "old-python; python_version < '3.11'"]),
        "pkg-b": FakeDist("2.1"),
        "shared": FakeDist("3.1"),
        "pinned": FakeDist("1.0.3", ["pinned-dep"]),  # in the image: its requirements are the image's business
        "loose": FakeDist("5.0"),
        "old": FakeDist("2.2", ["dep-of-old"]),
        "dep-of-old": FakeDist("0.1", ["shared>=3"]),
        "pkg-c": FakeDist("1.0", ["speedup; extra == 'fast'", "windows-only; sys_platform == 'win32'"]),
        "speedup": FakeDist("0.5"),
    }
    image = {"shared": "2.0", "pinned": None, "pinned-dep": None, "loose": None, "old": "1.5"}
    roots = [("hotlora", Requirement(r)) for r in
             ("pkg-a>=1", "pinned>=1.0,<1.1", "loose>=1", "old>=2", "pkg-c[fast]", "legacy; python_version < '3.11'")]
    items = needed(resolve(roots, image, fake_venv(dists), local_markers={"extra": ""}))
    # shared: the image's 2.0 satisfies pkg-a, not dep-of-old's >=3, which only a carried package asks for
    assert set(items) == {"pkg-a", "pkg-b", "pinned", "old", "dep-of-old", "pkg-c", "speedup", "shared"}
    assert items["pkg-a"].why.startswith("missing from the image; wanted by hotlora >=1")
    assert "transitive of pkg-a <- hotlora" in items["pkg-b"].why
    assert "unknown and the pin has an upper bound" in items["pinned"].why
    assert items["old"].why.startswith("the image has 1.5, outside >=2")
    assert "the image has 2.0, outside >=3" in items["shared"].why
    assert items["shared"].pin == "shared==3.1" and items["pkg-b"].specifier == ">=2"


def test_resolve_lean_tier_is_small_image_packages_only():
    dists = {"diffusers-like": FakeDist("1.0", ["pillow-like", "numpy-like"]),
             "pillow-like": FakeDist("10.0", ["tiny-dep"], size=2**20), "tiny-dep": FakeDist("1.0"),
             "numpy-like": FakeDist("2.0", ["under-numpy"], size=60 * 2**20), "under-numpy": FakeDist("1.0")}
    image = {"pillow-like": None, "numpy-like": None, "tiny-dep": None, "under-numpy": None}
    items = resolve([("hotlora", Requirement("diffusers-like"))], image, fake_venv(dists), local_markers={"extra": ""})
    assert {i.name: i.tier for i in items} == {"diffusers-like": "needed", "pillow-like": "lean", "tiny-dep": "lean"}


def test_a_new_requirement_travels_even_when_the_venv_lacks_it(tmp_path):
    """The check of the checker: a runtime dependency added to pyproject is carried without
    anyone editing a list, and one the venv does not have is still fetched, by specifier."""
    pyproject = tmp_path / "pyproject.toml"
    text = (REPO / "pyproject.toml").read_text()
    pyproject.write_text(text.replace('dependencies = [\n', 'dependencies = [\n    "brand-new-dependency>=1.2",\n', 1))
    items = needed(resolve(project_requirements(pyproject), read_image()))
    new = items["brand-new-dependency"]
    assert (new.version, new.pin) == (None, "brand-new-dependency>=1.2")
    assert "not installed in the venv" in new.why
    assert "brand-new-dependency" not in needed(resolve(project_requirements(REPO / "pyproject.toml"), read_image()))


def test_the_projects_plan_carries_pydantic_settings_and_its_requirements():
    items = resolve(project_requirements(REPO / "pyproject.toml"), read_image())
    carried = needed(items)
    assert {"pydantic-settings", "pydantic", "pydantic-core", "python-dotenv", "typing-inspection", "annotated-types",
            "diffusers", "peft", "torchao"} <= set(carried)
    assert not {"torch", "transformers", "accelerate", "huggingface-hub", "safetensors", "numpy"} & set(carried)
    assert "transitive of pydantic" in carried["pydantic-core"].why
    assert "hotlora[quant]" in carried["torchao"].why
    assert all(i.version for i in carried.values()), "every one at the venv's version"


def test_read_image_and_project_extras(tmp_path):
    (tmp_path / "image.txt").write_text("# a comment\nTorch==2.11.0\nsome_pkg  # why\n\n")
    assert read_image(tmp_path / "image.txt") == {"torch": "2.11.0", "some-pkg": None}
    owners = {owner for owner, _ in project_requirements(REPO / "pyproject.toml", ["all"])}
    assert {"hotlora", "hotlora[serve]", "hotlora[quant]"} <= owners  # all = hotlora[serve,...] expanded


def test_wheel_fits():
    assert wheel_fits("torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl", "3.12")
    assert wheel_fits("pydantic-2.0-py3-none-any.whl", "3.12")
    assert wheel_fits("pydantic_core-2.5-cp312-cp312-manylinux2014_x86_64.whl", "3.12")
    assert not wheel_fits("pydantic_core-2.5-cp311-cp311-manylinux2014_x86_64.whl", "3.12")
    assert not wheel_fits("x-1.0-cp313-abi3-manylinux2014_x86_64.whl", "3.12")
    assert not wheel_fits("x-1.0-cp312-cp312-macosx_11_0_arm64.whl", "3.12")


def test_install_list_installs_what_is_missing_or_outside_the_pin(tmp_path, capsys):
    python = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    packages = [
        {"name": "packaging", "version": "99.0", "specifier": ">=1", "wheels": ["packaging-99.0-py3-none-any.whl"]},
        {"name": "pytest", "version": "0.1", "specifier": "<1", "wheels": ["pytest-0.1-py3-none-any.whl"]},
        {"name": "no-such-package-here", "version": "1.0", "specifier": "",
         "wheels": [f"no_such_package_here-1.0-{python}-{python}-manylinux2014_x86_64.whl"]},
        {"name": "other-python-only", "version": "1.0", "specifier": "",
         "wheels": ["other_python_only-1.0-cp27-cp27mu-manylinux1_x86_64.whl"]},
    ]
    (tmp_path / device_deps.MANIFEST).write_text(json.dumps({"packages": packages}))
    assert install_list(tmp_path, err=sys.stderr) == ["pytest==0.1", "no-such-package-here==1.0"]
    err = capsys.readouterr().err
    assert "packaging: " in err and "already there" in err and "left to the import check" in err


def test_item_pin():
    assert Item("a", "1.0", ">=1", "needed", "").pin == "a==1.0"
    assert Item("a", None, ">=1", "needed", "").pin == "a>=1"


def write_dist(site, name, files):
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for f in files:
        (site / f).parent.mkdir(parents=True, exist_ok=True)
        (site / f).write_text("")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]))


def test_image_env_links_only_the_chosen_distributions(tmp_path):
    site, links = tmp_path / "site", tmp_path / "links"
    write_dist(site, "chosen", ["ns/chosen/__init__.py", "chosen_mod.py", "../../bin/chosen-script"])
    write_dist(site, "foreign", ["ns/foreign/__init__.py"])
    dists = device_env._site_distributions(site)
    device_env.link_distributions({"chosen"}, dists, site, links)
    assert (links / "ns").is_dir() and not (links / "ns").is_symlink()  # shared: a real folder
    assert (links / "ns" / "chosen").is_symlink() and (links / "chosen_mod.py").is_symlink()
    assert (links / "chosen-1.0.dist-info").is_symlink()
    assert not (links / "ns" / "foreign").exists() and not (links / "foreign-1.0.dist-info").exists()


def test_image_distributions_leave_out_what_the_wheels_carry():
    class Dist:
        def __init__(self, requires):
            self.requires = requires

    dists = {"hub": Dist(["httpx2", "typer"]), "typer": Dist(["pydantic"]), "httpx2": Dist([]), "pydantic": Dist([])}
    chosen, extra = device_env.image_distributions({"hub": None, "typer": None, "gone": None}, {"pydantic"}, dists)
    assert (chosen, extra) == ({"hub", "typer"}, {"httpx2"})


def test_bench_imports_finds_imports_inside_functions_and_follows_bench_modules(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "entry.py").write_text(
        "import json\n\ndef main():\n    from bench.other import thing\n    try:\n"
        "        import optional_accelerator\n    except ImportError:\n        pass\n")
    (tmp_path / "bench" / "other.py").write_text("def thing():\n    import no_such_package_xyz\n")
    imports = device_env.bench_imports("bench.entry", tmp_path)
    assert imports == [("json", None), ("bench.other", "thing"), ("no_such_package_xyz", None)]
    failures = device_env.check_imports([("json", "dumps"), ("json", "no_such_name"), ("no_such_package_xyz", None),
                                         ("importlib", "metadata")])  # a submodule: fine
    assert failures == ["json (no_such_name): ImportError: cannot import name 'no_such_name' from 'json'",
                        "no_such_package_xyz: ModuleNotFoundError: No module named 'no_such_package_xyz'"]


def test_the_gpu_bench_imports_resolve_here():
    """What device.sh's preflight tries on the machine, tried in the dev venv: a stale import in
    bench/ (a renamed hotlora module, a helper moved) fails here without a GPU or the network.
    bench/sizes.py: bench/gpu.sh runs it after device.sh on a GPU box of one's own."""
    imports = device_env.bench_imports()
    assert ("hotlora", "Engine") in imports and ("bench.swap", "swap_rows") in imports
    assert any(module.startswith("bench.gpu_rows") for module, _ in imports)
    assert device_env.check_imports(imports + device_env.bench_imports("bench.sizes")) == []


FAKE_PIP = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
dest, sizes = Path(args[args.index("-d") + 1]), json.loads(os.environ["FAKE_WHEEL_SIZES"])
pins = [a for a in args[args.index("-d") + 2:] if not a.startswith("-")]
if "--no-index" in args or any(pin.split("==")[0] not in sizes for pin in pins):
    sys.exit(1)  # no cache, and a package without a wheel fails the whole download, as pip does
for pin in pins:
    name, version = pin.split("==")
    (dest / f"{name}-{version}-py3-none-any.whl").write_bytes(b"x" * sizes[name])
"""


def test_fetch_keeps_within_the_limit_dropping_lean_wheels_first(tmp_path, monkeypatch):
    (tmp_path / "pip.py").write_text(FAKE_PIP)
    monkeypatch.setenv("FAKE_WHEEL_SIZES", json.dumps({"need": 100_000, "big": 300_000, "small": 50_000}))
    items = [Item("need", "1.0", ">=1", "needed", "missing"), Item("big", "2.0", "", "lean", "in the image"),
             Item("small", "3.0", "", "lean", "in the image"), Item("nowheel", "4.0", "", "lean", "in the image")]
    pip, dest = [sys.executable, str(tmp_path / "pip.py")], tmp_path / "whl"
    out = io.StringIO()
    manifest = device_deps.fetch(items, dest, ["3.12"], ["3.11"], 200_000, pip=pip, out=out)
    assert [p["name"] for p in manifest["packages"]] == ["need", "small"]
    assert sorted(manifest["dropped"]) == ["big", "nowheel"]
    assert sorted(w.name for w in dest.glob("*.whl")) == ["need-1.0-py3-none-any.whl", "small-3.0-py3-none-any.whl"]
    assert json.loads((dest / device_deps.MANIFEST).read_text()) == manifest
    assert "lean wheels left out (no wheel, or over the limit): nowheel, big" in out.getvalue()
    with pytest.raises(device_deps.DeviceDepsError, match="the needed wheels are 0.1 MiB, over the 0.0 MiB"):
        device_deps.fetch(items, dest, ["3.12"], [], 50_000, pip=pip, out=out)
