"""Draw ksy/leanimg.ksy as a diagram for the documentation site (spec/images/leanimg-ksy.svg).

The Kaitai Struct compiler (npm, installed by .ci/install) writes the .ksy as a graphviz graph
(``--target graphviz``) and graphviz's ``dot`` lays it out as SVG. The SVG is committed, so the
site builds without node or graphviz; tests/test_docs.py regenerates it and fails when it differs
from the committed one (run this script after changing the .ksy).

    python spec/tools/ksy_diagram.py            # rewrite spec/images/leanimg-ksy.svg
    python spec/tools/ksy_diagram.py --check    # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
KSY = REPO_DIR / "ksy" / "leanimg.ksy"
SVG = REPO_DIR / "spec" / "images" / "leanimg-ksy.svg"

# compile KSY (argv[2]) for graphviz with the compiler under the npm prefix argv[1]; the graph on stdout
COMPILE_JS = """
const fs = require('fs'), path = require('path');
const modules = path.join(path.resolve(process.argv[1]), 'node_modules');
const compiler = require(path.join(modules, 'kaitai-struct-compiler'));
const yaml = require(path.join(modules, 'js-yaml'));
compiler.compile('graphviz', yaml.load(fs.readFileSync(process.argv[2], 'utf8')), null, false)
  .then((files) => { process.stdout.write(Object.values(files)[0]); })
  .catch((err) => { console.error(String(err && (err.stack || err))); process.exit(1); });
"""


def graphviz_source(ksc_prefix: Path, ksy: Path = KSY) -> str:
    node = shutil.which("node") or "node"
    proc = subprocess.run(
        [node, "-e", COMPILE_JS, str(ksc_prefix), str(ksy)], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kaitai-struct-compiler --target graphviz failed:\n{proc.stderr}")
    return proc.stdout


def render_svg(dot_source: str) -> bytes:
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError("graphviz's dot is not installed (Debian: graphviz)")
    return subprocess.run(
        [dot, "-Tsvg"], input=dot_source.encode(), capture_output=True, check=True, timeout=300
    ).stdout


def diagram() -> bytes:
    sys.path.insert(0, str(REPO_DIR / "tests"))
    from kaitai_support import ensure_compiler  # finds (or installs) the compiler from npm

    return render_svg(graphviz_source(ensure_compiler()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed SVG")
    args = parser.parse_args()
    svg = diagram()
    if args.check:
        if SVG.read_bytes() != svg:
            print(f"{SVG} is out of date with {KSY}: run python spec/tools/ksy_diagram.py", file=sys.stderr)
            return 1
        return 0
    SVG.write_bytes(svg)
    print(f"wrote {SVG} ({len(svg)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
