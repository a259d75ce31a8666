"""The ``graphcomp`` console script: ``inspect``, ``passes``, ``demo``.

It depends only on the installed package. The benchmark harness lives in a source
checkout (``python -m benchmarks.run``, see ``benchmarks/README.md``)."""

from __future__ import annotations

import argparse
import sys


def _inspect(args: argparse.Namespace) -> int:
    from graphcomp.tools.inspect_dumps import inspect_dir

    if args.html:
        from graphcomp.tools.inspect_html import write_html

        try:
            if args.diff or args.stage or args.pass_name:
                raise ValueError("--html writes whole frames: it takes --rank and --frame, not --stage/--pass/--diff")
            out = write_html(args.dir, args.html, rank=args.rank, frame=args.frame)
        except ValueError as e:
            print(f"graphcomp inspect: {e}", file=sys.stderr)
            return 2
        print(f"wrote {out}")
        return 0
    try:
        text = inspect_dir(args.dir, rank=args.rank, frame=args.frame, stage=args.stage, pass_name=args.pass_name, diff=args.diff)
    except ValueError as e:
        print(f"graphcomp inspect: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _passes(args: argparse.Namespace) -> int:
    from graphcomp.compiler.pipeline import registered_passes

    for name, spec in registered_passes().items():
        stages = ", ".join(s for s in ("dynamo", "joint", "fwd", "bwd") if s in spec.stages)
        head = f"{name}  [{stages}; {'on' if spec.default else 'off'} by default]"
        if args.verbose:
            print(f"{head}\n\n{spec.doc}\n\n" + "-" * 72)
        else:
            first = spec.doc.split("\n\n")[0].replace("\n", " ")
            print(f"{head}\n    {first}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        # handed over whole: argparse's REMAINDER drops a first token that looks like
        # an option, so `graphcomp demo --steps 2` would be an error of the outer parser
        from graphcomp.tools.demo import launch

        return launch(argv[1:])
    p = argparse.ArgumentParser(prog="graphcomp", description="graphcomp: a torch.compile backend for sharded training")
    sub = p.add_subparsers(dest="cmd", required=True)

    pi = sub.add_parser("inspect", help="print what the passes did, from a dump directory")
    pi.add_argument("dir", help="Config.dump_dir / $GRAPHCOMP_DUMP_DIR of a run")
    pi.add_argument("--rank", type=int, default=0)
    pi.add_argument("--frame", type=int)
    pi.add_argument("--stage", choices=["dynamo", "joint", "fwd", "bwd", "inference"])
    pi.add_argument("--pass", dest="pass_name", metavar="PASS")
    pi.add_argument("--diff", action="store_true", help="unified diff of --pass's before/after graph")
    pi.add_argument("--html", metavar="OUT.html",
                    help="write one self-contained page (passes, pieces, collectives, memory charts) instead")

    pd = sub.add_parser("demo", help="train the demo Llama a few steps on 2 ranks (gloo CPU, or NCCL GPUs)")
    pd.add_argument("rest", nargs=argparse.REMAINDER, help="options for graphcomp.tools.demo (see --help there)")
    # (main hands `demo ...` to graphcomp.tools.demo.launch before parsing; this entry is for --help)

    pp = sub.add_parser("passes", help="list the passes in the order they run, with their stages and defaults")
    pp.add_argument("-v", "--verbose", action="store_true", help="print each pass's whole docstring (its pattern)")

    args = p.parse_args(argv)
    if args.cmd == "inspect":
        return _inspect(args)
    if args.cmd == "passes":
        return _passes(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
