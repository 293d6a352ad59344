"""`hotlora tiny-model | generate | serve | plan | keys new | adapters inspect | adapters convert | bench`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from hotlora.errors import DoesNotFit, HotloraError, RequestError, SettingUnusable
from hotlora.families import DEFAULT_FAMILY, FAMILIES, full_size_names

log = logging.getLogger("hotlora")
# hotlora.engine.plan.ACCELERATORS' names, here so the parser is built without importing torch.
ACCELERATOR_NAMES = ("h100-80gb", "h200-141gb", "a100-80gb", "l40s-48gb")


def _parse_lora(value: str) -> tuple[str, str, float]:
    """``slot=PATH[:SCALE]``; the scale is split from the right so paths may hold colons."""
    slot, sep, rest = value.partition("=")
    if not sep or not slot or not rest:
        raise argparse.ArgumentTypeError(f"expected SLOT=PATH[:SCALE], got {value!r}")
    path, scale = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    if colon:
        try:
            path, scale = head, float(tail)
        except ValueError:
            path, scale = rest, 1.0
    return slot, path, scale


def cmd_tiny_model(args) -> int:
    from hotlora.tiny import save_tiny_model

    began = time.perf_counter()
    out = save_tiny_model(Path(args.dir), args.family, seed=args.seed, edit=args.edit)
    print(f"tiny {args.family} pipeline written to {out} in {time.perf_counter() - began:.1f}s")
    for name in sorted((out / "adapters").iterdir()):
        print(f"  adapter: {name}")
    return 0


def cmd_generate(args) -> int:
    from hotlora import Engine
    from hotlora.settings import EngineConfig

    adapters = {}
    for slot, path, scale in args.lora:
        adapters[slot] = (path, scale)
    slots = tuple(args.slots.split(",")) if args.slots else tuple(dict.fromkeys(["identity", "style", *adapters]))
    config = EngineConfig(slots=slots, target_rank=args.target_rank, batch_size=args.batch_size,
                          compile=not args.no_compile, height=args.height, width=args.width)
    engine = Engine.from_pretrained(args.model, config)
    print(f"warm in {engine.warmup_s:.1f}s ({engine.compile_mode or 'eager'})", file=sys.stderr)
    from tqdm.auto import tqdm

    with tqdm(desc="denoising", unit="step", file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        result = engine.generate(
            args.prompt, adapters=adapters, num_images=args.n, num_inference_steps=args.steps,
            guidance_scale=args.guidance, seed=args.seed, output_type="pil", progress=progress,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for image, seed in zip(result.images, result.seeds):
        image.save(out / f"image-{seed}.png")
    summary = {
        "images": len(result.images), "out": str(out), "seeds": result.seeds, "adapters": result.adapters,
        "timings": result.timings.as_dict(), "recompiles": result.recompiles, "warmup_s": round(engine.warmup_s, 2),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _cli_store(args):
    from hotlora.families import family_named
    from hotlora.adapters.store import AdapterStore
    from hotlora.settings import StoreConfig

    # The operator's own offline command, never the server's path: any local path they can read
    # is fair game (the server's roots come from StoreConfig.local_roots and the catalog).
    config = StoreConfig.from_env(cache_dir=Path(args.cache_dir), local_roots=(Path.cwd(), Path("/")))
    return AdapterStore(config, family_named(args.family), catalog=args.catalog)


def cmd_adapters_inspect(args) -> int:
    from hotlora.adapters.format.export import describe

    store = _cli_store(args)
    print(json.dumps({**describe(store.get(args.ref)), "cache": store.stats()}, indent=2))
    return 0


def cmd_adapters_convert(args) -> int:
    from hotlora.adapters.format.export import save_as_diffusers

    store = _cli_store(args)
    adapter = store.get(args.ref)
    if args.low_noise is not None:  # Wan 2.2 A14B: the two experts' files as one adapter
        from hotlora.adapters.format.export import pair_experts

        adapter = pair_experts(adapter, store.get(args.low_noise))
    path = save_as_diffusers(adapter, args.out)
    print(f"written {path}")
    return 0


def serve_settings(args) -> tuple:
    """``hotlora serve``'s ServerConfig and StoreConfig from its flags (generated from the fields:
    ``_add_setting_flags``), over ``HOTLORA_*`` variables, over the ``--config`` file, over defaults."""
    from hotlora.settings import ServerConfig, StoreConfig
    from hotlora.settings.flags import given

    server_names, store_names = list(ServerConfig.model_fields), list(StoreConfig.model_fields)
    return ServerConfig.load(args.config, store_flags=given(args, store_names), **given(args, server_names))


def cmd_serve(args) -> int:
    config, store_config = serve_settings(args)
    if args.ray:  # one deployment per base model on Ray Serve; see docs/scale-out.md
        from hotlora.scaleout import RayServeConfig, run

        run(RayServeConfig.load(args.config, config, store_config))
        return 0
    ahead = None
    if config.engine_process:  # before the server's own imports (below): the child's run beside them
        from hotlora.engine.process import SpawnedAhead

        ahead = SpawnedAhead(str(config.model or store_config.tiny_model_dir(DEFAULT_FAMILY)), config.compile)
    try:
        return _serve(config, store_config, ahead)
    finally:
        if ahead is not None:
            ahead.discard()


def _serve(config, store_config, ahead) -> int:
    from hotlora.families import UnservedModel
    from hotlora.server.auth import AuthConfigError
    from hotlora.server.run import StartupFailed, serve

    try:
        serve(config, store_config, ahead)
    # Refused before anything listens: keys or settings unusable (an unwritable jobs_dir), a memory
    # plan that does not fit, a local model no family serves. Not engine faults: exit 2.
    except (AuthConfigError, DoesNotFit, SettingUnusable, UnservedModel) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StartupFailed as exc:  # the engine failed to start: the server stopped, the orchestrator sees it
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_families(args) -> int:
    """The model families this server serves: pipelines, guidance, what a request may set."""
    from hotlora.families import describe_families

    described = describe_families()
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    for entry in described:
        defaults = entry["defaults"]
        print(f"{entry['family']:12} {entry['pipeline']} (denoiser {entry['denoiser']}; guidance: {entry['cfg']})")
        print(f"{'':12} defaults: {defaults['num_inference_steps']} steps, guidance {defaults['guidance_scale']}, "
              f"{defaults['width']}x{defaults['height']}; text-encoder LoRA: "
              f"{', '.join(entry['text_encoder_lora']) or 'none'}; LoRA biases: {entry['lora_biases']}; "
              f"conv LoRA: {'on ' + entry['slot_convs'] + ' in every mode, ' if entry['slot_convs'] else ''}"
              f"fused mode; plans: {', '.join(entry['plans']) or 'none'}")
        alone = "".join(f"; a {cls} checkpoint serves {task} alone"
                        for cls, task in entry["single_task_checkpoints"].items())
        mixed = ("yes" + (f" (requests also share: {entry['mixed_batches_share']})" if "mixed_batches_share" in entry else "")
                 if entry["mixed"] else "no")
        print(f"{'':12} tasks: {', '.join(entry['tasks'])}{alone}; mixed batches: {mixed}")
        print(f"{'':12} a request may set: {', '.join(entry['request_options'])}")
    return 0


def cmd_plan(args) -> int:
    """The memory plan of ``hotlora serve`` with the same settings (flags, HOTLORA_* variables,
    --config), against a named accelerator, a size, or this machine; exit status 1 when it does not fit."""
    from hotlora.engine.plan import ACCELERATORS, parse_bytes, this_machine
    from hotlora.engine.device import default_device
    from hotlora.server.run import plan_serving

    config, _ = serve_settings(args)
    model = args.model_name or config.model
    if model is None:
        print("error: name a model: a local folder, a Hub id in the local cache, or one of "
              f"{' / '.join(full_size_names())}", file=sys.stderr)
        return 2
    engine_config = config.engine_config()
    device = engine_config.device or ("cuda" if args.gpu else default_device())
    if config.memory and str(config.memory).lower() != "off":
        budget, name = parse_bytes(config.memory), f"memory {config.memory}"
    elif args.gpu:
        budget, name = ACCELERATORS[args.gpu], args.gpu
    else:
        budget, name = this_machine(device.split(":")[0], device)
    plan, _ = plan_serving(model, engine_config, config.engine_process and config.engine_spare_process,
                           budget=budget, budget_name=name, device=device)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.text())
    return 0 if plan.fits is not False else 1


def cmd_keys_new(args) -> int:
    """A new API key (printed once: the server keeps only its hash) and the line for the keys file."""
    from hotlora.server.auth import AuthConfigError, new_key

    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    sources = [s.strip() for s in (args.sources or "").split(",") if s.strip()]
    try:
        key, line = new_key(args.name, scopes, sources)
    except AuthConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("the key, shown once (give it to the client, who sends it as 'Authorization: Bearer <key>'):",
          file=sys.stderr)
    print(key)
    print("the line for the server's keys file (--api-keys-file) or HOTLORA_API_KEYS:", file=sys.stderr)
    print(line)
    return 0


def source_checkout(given: str | None = None) -> Path | None:
    """The source checkout whose bench/ folder holds the benchmarks, which are not part of the
    installed package: ``given`` (``--repo``), else the current directory, else the checkout an
    editable install (`make install`, `pip install -e`) imports hotlora from. None when there is none."""
    import hotlora

    roots = [Path(given)] if given else [Path.cwd(), Path(hotlora.__file__).resolve().parents[2]]
    return next((root for root in roots if (root / "bench" / "harness.py").is_file()), None)


def cmd_bench(args) -> int:
    import runpy

    root = source_checkout(args.repo)
    if root is None:
        where = args.repo or "the current directory or where hotlora is installed from"
        print(f"error: no source checkout in {where}: the benchmarks live in the repository's bench/ folder and "
              "are not installed with the package; run `hotlora bench` inside a clone of the repository, or "
              "pass --repo DIR", file=sys.stderr)
        return 2
    script = root / "bench" / f"{args.name}.py"
    if not script.is_file():
        print(f"error: no benchmark {args.name!r} at {script}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _add_setting_flags(parser: argparse.ArgumentParser, plan_only: bool = False) -> None:
    """Every server, engine and store setting as a flag; the names are the fields' (one namespace:
    a store field may not share a server field's name). ``plan_only``: what a memory plan reads
    (the model, the memory, the engine's settings)."""
    from hotlora.settings import ServerConfig, StoreConfig
    from hotlora.settings.flags import add_flags
    from hotlora.settings.server import ENGINE_SETTINGS

    if plan_only:
        add_flags(parser, ServerConfig, "server settings ([server] in --config)", only=("model", "memory"))
        add_flags(parser, ServerConfig, "engine settings ([server] in --config)", only=ENGINE_SETTINGS)
        return
    own = [name for name in ServerConfig.model_fields if name not in ENGINE_SETTINGS]
    add_flags(parser, ServerConfig, "server settings ([server] in --config)", only=own)
    add_flags(parser, ServerConfig, "engine settings ([server] in --config)", only=ENGINE_SETTINGS)
    add_flags(parser, StoreConfig, "adapter store settings ([store] in --config)")


# Long: one argparse declaration per subcommand (tiny-model, generate, serve, plan, keys, bench, adapters), read top to bottom like --help.
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hotlora", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="build a tiny offline pipeline and sample adapters")
    tiny.add_argument("dir")
    tiny.add_argument("--family", choices=list(FAMILIES), default=DEFAULT_FAMILY)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--edit", action="store_true",
                      help="the family's edit checkpoint where it is another pipeline (qwenimage: Qwen-Image-Edit-2509)")
    tiny.set_defaults(run=cmd_tiny_model)

    gen = sub.add_parser("generate", help="generate one pack with hot-swapped adapters")
    gen.add_argument("--model", required=True, help="local model directory or hub id")
    gen.add_argument("--lora", type=_parse_lora, action="append", default=[], metavar="SLOT=PATH[:SCALE]")
    gen.add_argument("--slots", help="comma-separated slot names (default: identity,style)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("-n", type=int, default=1, help="images in the pack")
    gen.add_argument("--steps", type=int, default=None)
    gen.add_argument("--guidance", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--height", type=int, default=None)
    gen.add_argument("--width", type=int, default=None)
    gen.add_argument("--target-rank", type=int, default=16)
    gen.add_argument("--batch-size", default="auto", help="chunk size: auto (measured at warm-up) or an integer")
    gen.add_argument("--no-compile", action="store_true")
    gen.add_argument("--out", default="out")
    gen.set_defaults(run=cmd_generate)

    srv = sub.add_parser("serve", help="run the HTTP server (no --model: the built-in tiny model)")
    srv.add_argument("--config", help="TOML/YAML file with [server] and [store] tables (and [ray])")
    srv.add_argument("--ray", action="store_true", help="scale out on Ray Serve (models from the config's [ray] table)")
    _add_setting_flags(srv)
    srv.set_defaults(run=cmd_serve)

    fams = sub.add_parser("families", help="the model families served: pipelines, guidance, request options")
    fams.add_argument("--json", action="store_true")
    fams.set_defaults(run=cmd_families)

    plan = sub.add_parser("plan", help="the memory plan of `hotlora serve` with these settings: per part, per "
                                       "size, the largest chunk that fits, and a verdict")
    plan.add_argument("model_name", nargs="?", metavar="MODEL",
                      help="a local folder, a Hub id whose snapshot is in the local cache, or "
                           f"{' / '.join(full_size_names())} (the published configurations, also by their Hub "
                           "ids, e.g. Qwen/Qwen-Image; default: --model)")
    plan.add_argument("--gpu", choices=sorted(ACCELERATOR_NAMES), help="plan for this accelerator (CUDA, "
                                                                        "its nominal memory)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    plan.add_argument("--config", help="TOML/YAML file with a [server] table, as `hotlora serve` reads it")
    _add_setting_flags(plan, plan_only=True)
    plan.set_defaults(run=cmd_plan)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    new = keys.add_parser("new", help="print a new API key once, and the line the server's keys file needs")
    new.add_argument("--name", help="the key's name in logs and listings (default: the hash's first 8 digits)")
    new.add_argument("--scopes", default="generate,prefetch", help="comma-separated: generate, prefetch, metrics, "
                                                                   "admin (default generate,prefetch)")
    new.add_argument("--sources", help="comma-separated reference prefixes the key may use, e.g. "
                                       "s3://tenant-a/,catalog: (default: any)")
    new.set_defaults(run=cmd_keys_new)

    bench = sub.add_parser("bench", help="run a benchmark from bench/ (ablation, swap, mixed, affinity, ...)")
    bench.add_argument("--repo", metavar="DIR", help="the source checkout whose bench/ to run (default: the "
                       "current directory, else the checkout hotlora is installed from in editable mode)")
    bench.add_argument("name", help="ablation | swap | mixed | affinity | engine_figures | sizes | batch | text_encoders")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(run=cmd_bench)

    adapters = sub.add_parser("adapters", help="inspect or convert adapters").add_subparsers(dest="action", required=True)
    for name, run, text in (("inspect", cmd_adapters_inspect, "layout, rank, alpha, targets, base model, size, sha256"),
                            ("convert", cmd_adapters_convert, "convert to diffusers layout")):
        cmd = adapters.add_parser(name, help=text)
        cmd.add_argument("ref", help="path, https://, s3://, hf:// or catalog name")
        if name == "convert":
            cmd.add_argument("out", help="output directory")
            cmd.add_argument("--low-noise", default=None, metavar="REF",
                             help="a two-expert model (Wan 2.2 A14B): REF is the low-noise expert's LoRA (what diffusers "
                                  "loads with load_into_transformer_2=True), written as transformer_2.* beside ref's in "
                                  "one adapter")
        cmd.add_argument("--family", choices=list(FAMILIES), default=DEFAULT_FAMILY)
        cmd.add_argument("--cache-dir", default=".cache/hotlora")
        cmd.add_argument("--catalog", default=None)
        cmd.set_defaults(run=run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("hotlora").setLevel(logging.INFO)
    try:
        return args.run(args)
    except RequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except HotloraError as exc:
        print(f"engine error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
