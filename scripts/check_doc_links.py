"""Check that every relative link in README.md and docs/*.md resolves.

Usage: python scripts/check_doc_links.py   (exit status 1 and one line per broken link)

A link is ``[text](target)`` or ``![alt](target)``; URLs (``scheme:``) are skipped. The
target's file or folder must exist relative to the page, and a ``#fragment`` must match a
heading of the target page (GitHub's anchor rule: lower case, punctuation dropped, spaces
to hyphens).
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken(page: Path) -> list[str]:
    bad = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif frag and dest.is_file() and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def main() -> int:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [b for p in pages for b in broken(p)]
    print("\n".join(bad) if bad else f"{len(pages)} pages: every relative link resolves")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
