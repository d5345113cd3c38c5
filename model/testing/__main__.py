"""The fixture writers' command line.

``python -m model.testing --arch v4|v4-dspark|v41 --out DIR [--fp8] [--shards N] [--seed S]`` writes a tiny
checkpoint (``tiny``); ``--like v4-flash --layers L --experts E [--layout official|msmodelslim|...]`` a
width-faithful synthetic one instead (``release_like``); ``--layout`` without ``--like`` rewrites the fp32
toy in an msModelSlim layout.
"""

from __future__ import annotations

import argparse
import tempfile

from model.testing.release_like import LAYOUTS, LIKES, to_msmodelslim, write_like
from model.testing.tiny import ARCHS, write_tiny


def main() -> None:
    parser = argparse.ArgumentParser(
        "python -m model.testing", description="Write a tiny or a width-faithful checkpoint."
    )
    parser.add_argument("--arch", default="v4", choices=ARCHS)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--fp8", action="store_true", help="store the FP8 linears as E4M3 with E8M0 block scales"
    )
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--like", choices=tuple(LIKES), help="a release's widths with few layers and experts")
    parser.add_argument("--layers", type=int, default=2, help="with --like: backbone layers")
    parser.add_argument("--experts", type=int, default=16, help="with --like: routed experts")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="official",
        help="storage layout (without --like: of the fp32 toy)",
    )
    args = parser.parse_args()
    if args.like:
        print(write_like(args.out, args.like, args.layers, args.experts, args.layout, args.seed))
    elif args.layout != "official":  # msModelSlim W8A8 / W4A8 quantised from the fp32 toy
        with tempfile.TemporaryDirectory() as scratch:
            print(to_msmodelslim(write_tiny(scratch, args.arch, seed=args.seed), args.out, args.layout))
    else:
        print(write_tiny(args.out, args.arch, args.fp8, args.shards, args.seed))


if __name__ == "__main__":
    main()
