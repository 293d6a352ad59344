"""What an input image costs: decoding a client's bytes to a uint8 array, and encoding one.

Usage: .venv/bin/python bench/input_images.py [--repeats 5]

For 1024x1024 and 2048x2048 images (a photo-like test picture: smooth gradients plus sensor-like
noise, seeded), each timed ``--repeats`` times, median:

- decode, PNG / JPEG (quality 92) / WebP (quality 92): ``hotlora.images.decode_image`` (bytes ->
  uint8 array, every check) against the baseline measured in the same run, plain Pillow
  (``Image.open`` -> ``convert("RGB")`` -> ``np.asarray``), as a ratio; and the hand-written
  checks alone (the structure walk; for PNG also the IDAT completeness pass);
- encode, PNG / JPEG / WebP with the options ``server/images.py`` answers with.

Writes bench/results/input_images.{json,md}.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import markdown_table, write_results  # noqa: E402

SIZES = (1024, 2048)
OPTIONS = {"PNG": {}, "JPEG": {"quality": 92}, "WEBP": {"quality": 92}}  # as server/images.py encodes


def picture(side: int):
    import numpy as np

    rng = np.random.default_rng(side)
    y, x = np.mgrid[0:side, 0:side] / side
    channels = [127 + 100 * np.sin(2 * np.pi * (f1 * x + f2 * y) + phase)
                for f1, f2, phase in rng.uniform(0.5, 3.0, (3, 3))]
    noisy = np.stack(channels, axis=-1) + rng.normal(0, 6, (side, side, 3))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def median_ms(call, repeats: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        runs.append((time.perf_counter() - began) * 1000)
    return statistics.median(runs), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "bench" / "results"))
    args = parser.parse_args()

    import numpy as np
    from PIL import Image

    from hotlora import images
    from hotlora.images import ImageBudget, decode_image

    budget = ImageBudget()
    decode_rows, encode_rows, data = [], [], {"decode": {}, "encode": {}}
    for side in SIZES:
        pil = Image.fromarray(picture(side))
        for fmt, options in OPTIONS.items():
            def encode(fmt=fmt, options=options):
                out = io.BytesIO()
                pil.save(out, fmt, **options)
                return out.getvalue()

            encoded = encode()

            def pillow(encoded=encoded, fmt=fmt):
                return np.asarray(Image.open(io.BytesIO(encoded), formats=[fmt]).convert("RGB"))

            def ours(encoded=encoded):
                return decode_image(encoded, budget=budget).pixels

            def checks(encoded=encoded, fmt=fmt):
                layout = images._STRUCTURE[fmt](encoded, "image")
                if fmt == "PNG":
                    images._png_pixels_complete(encoded, layout, "image")

            assert np.array_equal(pillow(), ours())
            name = f"{side}x{side} {fmt}"
            base, base_runs = median_ms(pillow, args.repeats)
            full, full_runs = median_ms(ours, args.repeats)
            hand, hand_runs = median_ms(checks, args.repeats)
            enc, enc_runs = median_ms(encode, args.repeats)
            data["decode"][name] = {"bytes": len(encoded), "pillow_ms": base_runs, "decode_image_ms": full_runs,
                                    "hand_checks_ms": hand_runs, "ratio": full / base}
            data["encode"][name] = {"bytes": len(encoded), "options": options, "ms": enc_runs}
            decode_rows.append([name, f"{len(encoded) / 2**20:.2f}", round(base, 1), round(full, 1),
                                f"{full / base:.2f}x", round(hand, 1)])
            encode_rows.append([name, options or "defaults", f"{len(encoded) / 2**20:.2f}", round(enc, 1)])
    table = (markdown_table(["decode", "MiB", "Pillow alone (ms)", "decode_image (ms)", "ratio",
                             "of which hand checks (ms)"], decode_rows)
             + "\n\n" + markdown_table(["encode", "options", "MiB", "ms"], encode_rows))
    write_results(args.out, "input_images", data, table,
                  f"Input images (hotlora.images): bytes -> uint8 RGB array, median of {args.repeats}; "
                  "'Pillow alone' is Image.open -> convert('RGB') -> np.asarray in the same run; the hand checks "
                  "are the structure walk and, for PNG, the IDAT completeness pass (an extra inflate).")


if __name__ == "__main__":
    main()
