"""The GPU machine's Python, imitated here, and the import check bench/device.sh runs there.

    python -m bench.device_env image-env DIR     # a venv holding only the image's packages, from this one
    python -m bench.device_env imports           # every import the GPU bench makes, tried (preflight)

``image-env``: the image (bench/device-image.txt) is what device.sh meets on a lent GPU machine;
a dependency the wheels do not carry fails there only after minutes of start-up, so CI builds the
same situation on the CPU. The venv has no system site packages; a .pth points it at a folder of
symlinks to the files of this venv's distributions that the image also has (found through their
RECORD), so building it copies nothing. Where this venv's copy of an image package is newer than
the image's and needs a package the image list lacks (huggingface_hub 2.x wants httpx2), that one is
linked too: the image's own copy evidently does without it. What the carried wheels provide never
is: it must come from them, as it will there.

``imports``: the modules device.sh needs, then every import statement of bench/gpu_flux.py and of
the bench modules it imports, wherever it stands (most are inside functions), so a module renamed
in hotlora or a package missing fails here, before any GPU time, without a list kept by hand.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench import device_deps

REPO = Path(__file__).resolve().parents[1]
BENCH_ENTRY = "bench.gpu_flux"
# What device.sh itself uses, besides what the bench imports.
BASE_MODULES = ("torch", "diffusers", "peft", "transformers", "accelerate", "huggingface_hub", "safetensors", "numpy",
                "hotlora", "hotlora.engine")


def _site_distributions(site: Path) -> dict[str, md.Distribution]:
    found = {}
    for dist in md.distributions(path=[str(site)]):
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def image_distributions(image: dict, carried: set[str], dists: dict[str, md.Distribution]) -> tuple[set[str], set[str]]:
    """(image packages this venv has, the packages they need that the image list lacks and the
    wheels do not carry), the latter followed for this interpreter."""
    chosen = {n for n in image if n in dists}
    extra: set[str] = set()
    todo = list(chosen)
    while todo:
        for text in dists[todo.pop()].requires or []:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if name in dists and name not in chosen and name not in extra and name not in carried:
                extra.add(name)
                todo.append(name)
    return chosen, extra


def link_distributions(names: set[str], dists: dict[str, md.Distribution], site: Path, links: Path) -> int:
    """Symlink into ``links`` the files of ``names``: each at its shortest path that no other
    distribution of ``site`` has files under (a shared namespace folder becomes a real folder)."""
    def paths(dist) -> list[tuple[str, ...]]:
        return [Path(f).parts for f in dist.files or [] if ".." not in Path(f).parts]

    foreign = {p[:k] for n, d in dists.items() if n not in names for p in paths(d) for k in range(1, len(p) + 1)}
    placed: set[tuple[str, ...]] = set()
    for name in names:
        for parts in paths(dists[name]):
            cut = next((k for k in range(1, len(parts) + 1) if parts[:k] not in foreign), len(parts))
            prefix = parts[:cut]
            if prefix in placed or not (site.joinpath(*prefix)).exists():
                continue
            placed.add(prefix)
            target = links.joinpath(*prefix)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(site.joinpath(*prefix))
    return len(placed)


def build_image_env(target: Path, image_file: Path = device_deps.IMAGE_FILE, pyproject: Path = REPO / "pyproject.toml",
                    python: str = sys.executable) -> dict:
    """A venv at ``target`` holding only the image's packages (as this venv has them)."""
    site = Path(sysconfig.get_paths()["purelib"])
    dists = _site_distributions(site)
    image = device_deps.read_image(image_file)
    needed = {i.name for i in device_deps.resolve(device_deps.project_requirements(pyproject), image) if i.tier == "needed"}
    chosen, extra = image_distributions(image, needed, dists)
    subprocess.run([python, "-m", "venv", "--without-pip", "--clear", str(target)], check=True)
    env_python = target / "bin" / "python"
    env_site = Path(subprocess.run([str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    links = target / "image-packages"
    count = link_distributions(chosen | extra, dists, site, links)
    (env_site / "device-image.pth").write_text(f"{links}\n")
    return {"python": str(env_python), "image_packages": sorted(chosen), "not_in_image_list": sorted(extra),
            "absent_here": sorted(set(image) - chosen), "links": count}


def _optional(handler: ast.ExceptHandler) -> bool:
    """An ``except ImportError`` (or ModuleNotFoundError): the optional-import idiom. A row's
    ``except Exception`` keeps one failure from costing the others; its imports still count."""
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def bench_imports(entry: str = BENCH_ENTRY, root: Path = REPO) -> list[tuple[str, str | None]]:
    """(module, name or None) for every import statement in ``entry`` and the bench modules it
    imports; one inside ``try: ... except ImportError`` is optional, the module's own business."""
    found, todo, seen = [], [entry], set()
    while todo:
        module = todo.pop()
        path = root / (module.replace(".", "/") + ".py")
        if module in seen or not path.exists():
            continue
        seen.add(module)
        tree = ast.parse(path.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(map(_optional, t.handlers))
                   for s in t.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            if isinstance(node, ast.Import):
                found += [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module != "__future__":
                found += [(node.module, alias.name) for alias in node.names]
        todo += [m for m, _ in found if m.startswith("bench.")]
    return list(dict.fromkeys(found))


def check_imports(imports) -> list[str]:
    """One line per import that fails."""
    failures = []
    for module, name in imports:
        try:
            imported = importlib.import_module(module)
            if name not in (None, "*") and not hasattr(imported, name):
                try:  # a submodule, not yet an attribute
                    importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError as exc:
                    if exc.name != f"{module}.{name}":
                        raise
                    raise ImportError(f"cannot import name {name!r} from {module!r}") from None
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run stops
            failures.append(f"{module}{f' ({name})' if name else ''}: {type(exc).__name__}: {exc}")
    return failures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("image-env")
    env.add_argument("target", type=Path)
    sub.add_parser("imports")
    args = parser.parse_args(argv)
    if args.command == "image-env":
        built = build_image_env(args.target.resolve())
        print(f"{built['python']}: {len(built['image_packages'])} of the image's packages ({built['links']} links); "
              f"linked besides, needed by this venv's newer copies: {', '.join(built['not_in_image_list']) or 'none'}")
        return
    modules = [(m, None) for m in BASE_MODULES] + bench_imports()
    failures = check_imports(modules)
    for line in failures:
        print(f"  FAIL {line}")
    print(f"  {len(modules) - len(failures)} of {len(modules)} imports of the bench ok")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
