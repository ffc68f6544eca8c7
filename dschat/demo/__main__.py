"""``python -m dschat.demo tokenizer`` rebuilds assets/tokenizer.model; ``python -m dschat.demo data DIR`` writes the
demo JSONL files into DIR."""

from __future__ import annotations

import argparse

from dschat.demo.corpus import write_demo_files
from dschat.demo.tokenizer import build_tokenizer_model
from dschat.models.tiny import VOCAB_SIZE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dschat.demo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tokenizer", help="rebuild the shipped tokenizer.model from the demo corpus")
    data = sub.add_parser("data", help="write pairwise.jsonl, prompts.jsonl and judge.jsonl")
    data.add_argument("out_dir")
    data.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "tokenizer":
        path = build_tokenizer_model()
        print(f"wrote {path} ({path.stat().st_size} bytes, vocab {VOCAB_SIZE})")
    else:
        for path in write_demo_files(args.out_dir, seed=args.seed).values():
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
