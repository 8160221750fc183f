"""mkdocs hooks (mkdocs.yml ``hooks:``): publish files that live outside docs_dir on the site.

ksy/leanimg.ksy and the JSON Schemas of lean-image/schemas/ stay where the code uses them;
the site gets them as downloads, unchanged, next to the pages that describe them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

REPO_DIR = Path(__file__).resolve().parents[2]
PUBLISHED = {
    "ksy/leanimg.ksy": REPO_DIR / "ksy" / "leanimg.ksy",
    **{f"schemas/{path.name}": path for path in sorted((REPO_DIR / "lean-image" / "schemas").glob("*.json"))},
}


def on_files(files, config):
    for uri, path in PUBLISHED.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
