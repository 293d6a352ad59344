"""What the lent GPU machine must be given in .whl/, derived rather than listed by hand: hotlora's
declared runtime requirements (pyproject's ``dependencies`` and the extras the GPU bench uses),
followed through the installed distributions' metadata as pip would resolve them on the image's
Python (3.12, x86-64 Linux), less what the image already has (bench/device-image.txt).

    python -m bench.device_deps plan                   # what would travel, and why (dev machine)
    python -m bench.device_deps fetch --dest .whl --python 3.12 [--local-python 3.11] [--limit-bytes N]
    python -m bench.device_deps install-list .whl      # on the machine: name==version to install there

Two tiers. ``needed``: what the image lacks, or has at a version outside what hotlora (or a carried
package) requires, or at an unknown version where the requirement has an upper bound (diffusers,
peft: mirrored call for call, so pinned to a minor version). ``lean``: small packages the image has
but an environment with only part of its set may lack (the CPU dry run in a venv of torch,
transformers and peft alone lacks pillow and requests); carried for ``--local-python`` (a pure
wheel serves the image too), and dropped first when the budget is short. ``--local-python`` also
gets the needed wheels: the dry run here installs everything the GPU machine does. bench/device.sh installs either only where the machine's
own version is missing or outside the recorded specifier (``install-list``, from manifest.json).

Imports only the standard library and packaging: ``install-list`` runs under the machine's python3.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
IMAGE_FILE = REPO / "bench" / "device-image.txt"
MANIFEST = "manifest.json"
IMAGE_PYTHON = "3.12"
# PEP 508 markers of the image's interpreter: a requirement for Windows or Python < 3.11 is not its.
IMAGE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                 "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
                 "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
                 "platform_release": "", "platform_version": ""}
BENCH_EXTRAS = ("quant",)  # torchao: the float8_base and int8_base rows
# A lean copy is for an environment missing a small part of the image's set; one that lacks numpy or
# transformers is not the image, and their wheels would crowd out what the GPU needs.
LEAN_MAX_BYTES = 24 * 2**20
UPPER_BOUNDS = {"<", "<=", "==", "===", "~="}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")


class DeviceDepsError(Exception):
    """The venv, the image list or a download cannot give the machine what the bench needs."""


@dataclass
class Need:
    """One package some carried requirement reaches, with every requirer's specifier combined."""

    name: str
    via: str  # the first requirer reached, for "transitive of"
    specifier: SpecifierSet = field(default_factory=SpecifierSet)
    wanted_by: dict[str, str] = field(default_factory=dict)  # requirer -> its specifier text

    def wants(self) -> str:
        return ", ".join(f"{who} {spec}".rstrip() for who, spec in self.wanted_by.items())


@dataclass
class Item:
    name: str
    version: str | None  # the venv's; None: not installed there, pip takes the newest within specifier
    specifier: str
    tier: str  # "needed" or "lean"
    why: str

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}" if self.version else f"{self.name}{self.specifier}"


def read_image(path: Path = IMAGE_FILE) -> dict[str, str | None]:
    """``name`` or ``name==version`` per line, ``#`` comments: canonical name -> version or None."""
    image = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[canonicalize_name(name.strip())] = version.strip() or None
    return image


def project_requirements(pyproject: Path, extras=BENCH_EXTRAS) -> list[tuple[str, Requirement]]:
    """(owner, requirement) for the project's dependencies and ``extras``; a self-reference such as
    ``hotlora[serve,quant]`` expands into those extras."""
    import tomllib  # dev machine only (Python >= 3.11): install-list never reads pyproject

    project = tomllib.loads(pyproject.read_text())["project"]
    name, optional = canonicalize_name(project["name"]), project.get("optional-dependencies", {})
    out, todo, seen = [], deque(["", *extras]), set()
    while todo:
        extra = todo.popleft()
        if extra in seen:
            continue
        seen.add(extra)
        if extra and extra not in optional:
            raise DeviceDepsError(f"pyproject has no extra {extra!r} (known: {', '.join(optional)})")
        for text in project["dependencies"] if not extra else optional[extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == name:
                todo.extend(req.extras)
            elif req.marker is None or req.marker.evaluate({**IMAGE_MARKERS, "extra": extra}):
                out.append((f"{name}[{extra}]" if extra else name, req))
    return out


def _installed(name: str):
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def walk(roots, follow: Callable[[str], bool], distribution=_installed, markers=IMAGE_MARKERS) -> dict[str, Need]:
    """Every package the roots reach, following the requirements (markers evaluated for ``markers``,
    a requirement's extras only where it asks for them) of each package ``follow`` accepts."""
    needs: dict[str, Need] = {}
    queue = deque((o, r) for o, r in roots if r.marker is None or r.marker.evaluate({**markers, "extra": ""}))
    expanded: set[tuple[str, str]] = set()
    while queue:
        owner, req = queue.popleft()
        name = canonicalize_name(req.name)
        need = needs.setdefault(name, Need(name, via=owner))
        need.specifier &= req.specifier
        need.wanted_by[owner] = str(req.specifier)
        dist = distribution(name) if follow(name) else None
        if dist is None:
            continue
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in expanded:
                continue
            expanded.add((name, extra))
            for text in dist.requires or []:
                r = Requirement(text)
                applies = r.marker is None or r.marker.evaluate({**markers, "extra": extra})
                # with an extra: only what that extra adds (the rest came with extra "")
                if applies and not (extra and (r.marker is None or r.marker.evaluate({**markers, "extra": ""}))):
                    queue.append((name, r))
    return needs


def tight(specifier: SpecifierSet) -> bool:
    """Whether a specifier bounds the version from above (a pin to a minor version, an exact one)."""
    return any(s.operator in UPPER_BOUNDS for s in specifier)


def carry_reason(need: Need, image: dict[str, str | None]) -> str | None:
    """Why the image's own copy will not do, or None when it will."""
    if need.name not in image:
        return "missing from the image"
    have = image[need.name]
    if have is None:
        return "the image's version is unknown and the pin has an upper bound" if tight(need.specifier) else None
    if not need.specifier.contains(have, prereleases=True):
        return f"the image has {have}, outside {need.specifier}"
    return None


def _chain(needs: dict[str, Need], name: str) -> str:
    hops, seen = [], {name}
    while (via := needs[name].via) in needs and via not in seen:
        hops.append(via)
        seen.add(via)
        name = via
    hops.append(needs[name].via)
    return " <- ".join(hops)


def _item(need: Need, needs: dict[str, Need], tier: str, reason: str, distribution) -> Item:
    dist = distribution(need.name)
    direct = need.via not in needs
    why = f"{reason}; {'wanted by ' + need.wants() if direct else 'transitive of ' + _chain(needs, need.name)}"
    if dist is None:
        why += " (not installed in the venv: the newest release within the specifier)"
    elif not need.specifier.contains(dist.version, prereleases=True):
        raise DeviceDepsError(f"the venv has {need.name} {dist.version}, outside {need.wants()}: reinstall it")
    return Item(need.name, dist.version if dist else None, str(need.specifier), tier, why)


def installed_bytes(dist) -> int:
    return sum(f.size or 0 for f in dist.files or [])


def resolve(roots, image: dict[str, str | None], distribution=_installed, lean_max: int = LEAN_MAX_BYTES,
            local_markers: dict | None = None) -> list[Item]:
    """The packages to carry: ``needed`` ones (the image's copy will not do), then ``lean`` ones."""
    carried: set[str] = set()

    def follow(name: str) -> bool:
        return name not in image or name in carried

    while True:  # carrying a package follows its requirements, which may narrow another's specifier
        needs = walk(roots, follow, distribution)
        reasons = {n: r for n, need in needs.items() if (r := carry_reason(need, image))}
        if reasons.keys() <= carried:
            break
        carried |= reasons.keys()
    items = [_item(needs[n], needs, "needed", reasons[n], distribution) for n in needs if n in reasons]

    def small(name: str) -> bool:
        dist = distribution(name)
        return name not in carried and dist is not None and installed_bytes(dist) <= lean_max

    # Lean copies are the venv's versions, installed only where missing: their own requirements are
    # followed for the interpreter they are for (the venv's), whatever the image list says.
    seeds = [(need.via, Requirement(f"{n}{need.specifier}")) for n, need in needs.items() if n not in carried and small(n)]
    for n, need in walk(seeds, small, distribution, local_markers or _default_markers()).items():
        if small(n):
            # What the image's own packages need of it is the first walk's; a lean-only one (wanted
            # by the venv's newer copy of a lean package) has only the lean walk's.
            source = needs.get(n) or need
            where = "in the image" if n in image else "not in the image list (a newer lean copy wants it)"
            items.append(Item(n, distribution(n).version, str(source.specifier), "lean",
                              f"{where}; wanted by {source.wants()}"))
    return items


def _default_markers() -> dict:
    from packaging.markers import default_environment

    return dict(default_environment())


def print_plan(items: list[Item], out=sys.stdout) -> None:
    for tier, title in (("needed", "carried for the GPU machine"),
                        ("lean", "carried for a leaner environment (the image has them; installed only where missing)")):
        rows = [i for i in items if i.tier == tier]
        print(f"{title}: {len(rows)}", file=out)
        for item in rows:
            print(f"  {item.pin:34s} {item.why}", file=out)


def wheel_fits(wheel: str, python: str) -> bool:
    """Whether pip on CPython ``python`` (e.g. "3.12") on x86-64 Linux installs this wheel."""
    minor = int(python.split(".")[1])
    _, _, _, tags = parse_wheel_filename(wheel)

    def interpreter_ok(t):
        if t.interpreter in (f"cp3{minor}", "py3"):
            return True  # cpXY-abi3 (torchao: cp310-abi3) installs on every CPython from X.Y on
        return t.abi == "abi3" and t.interpreter.startswith("cp3") and int(t.interpreter[3:]) <= minor

    return any(interpreter_ok(t) and ("x86_64" in t.platform or t.platform == "any") for t in tags)


def _download(pip: list[str], pins: list[str], python: str, dest: Path, cache: Path | None) -> None:
    """pip download of exactly these wheels for CPython ``python``; from ``cache`` alone when it
    holds them all (a rerun needs no network), else from the index, then kept in ``cache``."""
    if not pins:
        return
    args = [*pip, "download", "-q", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
            "--python-version", python, "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS],
            "-d", str(dest), *pins]
    if cache is not None and cache.is_dir():
        offline = subprocess.run([*args, "--no-index", "--find-links", str(cache)], capture_output=True, text=True,
                                 check=False)
        if offline.returncode == 0:
            return
    online = subprocess.run(args, capture_output=True, text=True, check=False)
    if online.returncode != 0:
        raise DeviceDepsError(f"pip download for CPython {python} failed:\n{online.stderr.strip()[-3000:]}")
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for wheel in dest.glob("*.whl"):
            if not (cache / wheel.name).exists():
                # Copied aside, then renamed: a run killed mid-copy leaves a ``.part`` that
                # --find-links never reads, not a truncated wheel the next run would trust.
                partial = cache / f"{wheel.name}.part"
                shutil.copy2(wheel, partial)
                os.replace(partial, cache / wheel.name)


def fetch(items: list[Item], dest: Path, pythons: list[str], local_pythons: list[str], limit_bytes: int,
          cache: Path | None = None, pip: list[str] | None = None, out=sys.stdout) -> dict:
    """Download every item's wheels into ``dest`` (emptied first: two versions of one package stop
    the install there), check each installs where it must, keep within ``limit_bytes`` (dropping
    lean wheels, largest first) and write the manifest install-list reads."""
    pip = pip or [sys.executable, "-m", "pip"]
    dest.mkdir(parents=True, exist_ok=True)
    for stale in [*dest.glob("*.whl"), dest / MANIFEST]:
        stale.unlink(missing_ok=True)
    tiers = {"needed": list(dict.fromkeys([*pythons, *local_pythons])), "lean": local_pythons}
    lean = [i for i in items if i.tier == "lean"]
    for python in tiers["needed"]:
        print(f"== needed wheels for CPython {python}", file=out)
        _download(pip, [i.pin for i in items if i.tier == "needed"], python, dest, cache)
    for python in tiers["lean"]:
        print(f"== lean wheels for CPython {python}", file=out)
        try:
            _download(pip, [i.pin for i in lean], python, dest, cache)
        except DeviceDepsError:  # one lean package without a wheel must not cost the others
            for item in lean:
                try:
                    _download(pip, [item.pin], python, dest, cache)
                except DeviceDepsError:
                    print(f"  {item.pin}: no wheel for CPython {python}, left out", file=out)
    wheels: dict[str, list[Path]] = {}
    for wheel in sorted(dest.glob("*.whl")):
        wheels.setdefault(canonicalize_name(parse_wheel_filename(wheel.name)[0]), []).append(wheel)
    total, dropped = _keep_installable_within(items, wheels, tiers, limit_bytes)
    packages = [{"name": i.name, "version": str(parse_wheel_filename(wheels[i.name][0].name)[1]),
                 "specifier": i.specifier, "tier": i.tier, "why": i.why, "wheels": [w.name for w in wheels[i.name]]}
                for i in items if i.name in wheels]
    manifest = {"image_python": pythons[0] if pythons else IMAGE_PYTHON, "packages": packages, "dropped": dropped}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for wheel in sorted(w for ws in wheels.values() for w in ws):
        print(f"{wheel.stat().st_size:10d}  {wheel.name}", file=out)
    count = sum(len(ws) for ws in wheels.values())
    print(f"{total:10d}  total: {count} wheels, {total / 2**20:.1f} MiB (limit {limit_bytes / 2**20:.1f} MiB)", file=out)
    if dropped:
        print(f"lean wheels left out (no wheel, or over the limit): {', '.join(dropped)}", file=out)
    return manifest


def _keep_installable_within(items: list[Item], wheels: dict[str, list[Path]], tiers: dict, limit_bytes: int):
    """Fail unless every needed package has a wheel for each of its pythons; delete the lean ones
    without, then lean ones largest first until the total fits: (total bytes, names left out)."""
    missing = {(i.name, i.tier, python) for i in items for python in tiers[i.tier]
               if not any(wheel_fits(w.name, python) for w in wheels.get(i.name, []))}
    if problems := sorted(f"{name}: no wheel for CPython {python} on x86-64 Linux" for name, tier, python in missing
                          if tier == "needed"):
        raise DeviceDepsError("; ".join(problems))

    def size(name: str) -> int:
        return sum(w.stat().st_size for w in wheels.get(name, []))

    def drop(name: str) -> None:
        dropped.append(name)
        for wheel in wheels.pop(name, []):
            wheel.unlink()

    dropped: list[str] = []
    for name in sorted({name for name, _, _ in missing}):
        drop(name)
    total = sum(size(i.name) for i in items)
    for item in sorted((i for i in items if i.tier == "lean" and i.name in wheels), key=lambda i: -size(i.name)):
        if total <= limit_bytes:
            break
        total -= size(item.name)
        drop(item.name)
    if total > limit_bytes:
        raise DeviceDepsError(f"the needed wheels are {total / 2**20:.1f} MiB, over the {limit_bytes / 2**20:.1f} MiB "
                              "the device call can carry besides the repository")
    return total, dropped


def install_list(dest: Path, err=sys.stderr) -> list[str]:
    """On the machine: name==version of each carried package its python lacks or has outside the
    recorded specifier; why each is or is not installed goes to ``err``."""
    path = dest / MANIFEST
    if not path.exists():
        raise DeviceDepsError(f"no {path}: run 'bash bench/device-wheels.sh' on the dev machine")
    wanted, python = [], f"{sys.version_info[0]}.{sys.version_info[1]}"
    for package in json.loads(path.read_text())["packages"]:
        name, version, spec = package["name"], package["version"], SpecifierSet(package["specifier"])
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None:
            print(f"  {name}: missing -> {version} from {dest.name}", file=err)
        elif not spec.contains(have, prereleases=True):
            print(f"  {name}: {have} is outside {spec} -> {version} from {dest.name}", file=err)
        else:
            print(f"  {name}: {have} already there{f' ({spec})' if spec else ''}", file=err)
            continue
        if not any(wheel_fits(w, python) for w in package["wheels"]):  # a lean one built for another python
            print(f"    no wheel of it for CPython {python} here: left to the import check", file=err)
            continue
        wanted.append(f"{name}=={version}")
    return wanted


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "fetch"):
        p = sub.add_parser(name)
        p.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
        p.add_argument("--image", type=Path, default=IMAGE_FILE)
        p.add_argument("--extras", default=",".join(BENCH_EXTRAS), help="pyproject extras the bench needs")
        p.add_argument("--require", action="append", default=[], help="one more requirement (a check of the checker)")
    fetch_args = sub.choices["fetch"]
    fetch_args.add_argument("--dest", type=Path, required=True)
    fetch_args.add_argument("--python", action="append", default=[], help="CPython X.Y for the needed wheels")
    fetch_args.add_argument("--local-python", action="append", default=[],
                            help="CPython X.Y of a dry run here: the needed and the lean wheels")
    fetch_args.add_argument("--limit-bytes", type=int, default=60 * 2**20)
    fetch_args.add_argument("--cache", type=Path, default=None, help="wheels kept between runs")
    install = sub.add_parser("install-list")
    install.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "install-list":
            print("\n".join(install_list(args.dest)))
            return
        roots = project_requirements(args.pyproject, [e for e in args.extras.split(",") if e])
        roots += [("--require", Requirement(r)) for r in args.require]
        image = read_image(args.image)
        items = resolve(roots, image)
        if args.command == "fetch" and not args.local_python:  # the lean tier is for a dry run here
            items = [i for i in items if i.tier == "needed"]
        print_plan(items)
        if args.command == "fetch":
            fetch(items, args.dest, args.python or [IMAGE_PYTHON], args.local_python, args.limit_bytes, args.cache)
    except DeviceDepsError as exc:
        sys.exit(f"device_deps: {exc}")


if __name__ == "__main__":
    main()
