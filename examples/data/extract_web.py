"""How web_genesis_exodus.txt was made: plain text from Debian's ``sword-text-web`` package.

The package holds the World English Bible as a SWORD "zText" module: ``ot.bzs`` indexes
zlib-compressed blocks of ``ot.bzz``, one block per book after a header block, each block the
book's OSIS markup (Strong's numbers on every word, footnotes, titles, poetry lines). This keeps
the words, titles, chapter numbers, paragraphs and poetry lines, and drops the footnotes and
the markup::

    apt-get download sword-text-web && dpkg-deb -x sword-text-web_*.deb sword
    python examples/data/extract_web.py sword/usr/share/sword/modules/texts/ztext/engWEB2015eb \\
        --books 2 > examples/data/web_genesis_exodus.txt
"""
from __future__ import annotations

import argparse
import html
import re
import struct
import zlib
from pathlib import Path


def books(module_dir: Path, testament: str = "ot") -> list[str]:
    """The OSIS markup of each book of ``testament``, in canonical order."""
    index = (module_dir / f"{testament}.bzs").read_bytes()
    data = (module_dir / f"{testament}.bzz").read_bytes()
    out = []
    for k in range(1, len(index) // 12):  # 12 bytes per block: offset, size, uncompressed size
        offset, size, _ = struct.unpack("<III", index[12 * k:12 * k + 12])
        out.append(zlib.decompress(data[offset:offset + size]).decode("utf-8"))
    return out


def plain(osis: str) -> str:
    """OSIS markup to plain text: footnotes dropped, a blank line between paragraphs."""
    text = re.sub(r"<note\b.*?</note>", " ", osis, flags=re.S)
    text = re.sub(r'<chapter\b[^>]*\bn="(\d+)"[^>]*sID[^>]*/>', r"\n\nChapter \1\n\n", text)
    text = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\n\1\n\n", text, flags=re.S)
    text = re.sub(r'<div\b[^>]*eID="[^"]*"[^>]*type="x-p"[^>]*/>', "\n\n", text)
    text = re.sub(r"<l\b[^>]*eID[^>]*/>|<lb\b[^>]*/>", "\n", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = html.unescape(text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" +([.,;:!?’”)])", r"\1", text)  # a dropped footnote left a space before it
    text = re.sub(r" *\n *", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module_dir", type=Path, help="the engWEB2015eb folder of the SWORD module")
    parser.add_argument("--books", type=int, default=2, help="how many books, from Genesis on")
    args = parser.parse_args()
    print("\n\n".join(plain(b) for b in books(args.module_dir)[:args.books]))


if __name__ == "__main__":
    main()
