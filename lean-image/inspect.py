"""What is in an image: header, regions, disks, chain, and a per-class breakdown."""

from __future__ import annotations

import enum
import uuid as uuidlib
from collections import Counter

import numpy as np

from .format import CompatFeature, IncompatFeature, PageClass, RecordType
from .reader import LeanImage

MIB = 1024 * 1024


def class_counts(image: LeanImage, region=None) -> Counter[int]:
    counts: Counter[int] = Counter()
    for r in [region] if region else image.regions:
        e = r.extents
        totals = np.bincount(e["page_class"].astype(np.int64), weights=e["num_pages"].astype(np.float64), minlength=7)
        for cls in PageClass:
            counts[cls] += int(totals[cls])
    return counts


def class_dict(counts: Counter[int]) -> dict[str, int]:
    """Page counts by class name, the classes without a page left out: the one shape of
    ``classes`` in every JSON output (spec/guides/json.md)."""
    return {cls.name: int(counts[cls]) for cls in PageClass if counts[cls]}


def feature_names(bits: int, names: type[enum.IntFlag]) -> list[str]:
    """The set bits of a header feature field by name; a bit this version does not know as ``bit<N>``."""
    known = sum(names)  # (a known single bit always has a name)
    return [(names(1 << k).name if (1 << k) & known else None) or f"bit{k}" for k in range(64) if bits >> k & 1]


def record_bytes(image: LeanImage) -> dict[str, int]:
    """Bytes of the file taken by each record type (header and footer apart)."""
    entries = image.index_entries
    offsets = np.append(entries["record_offset"].astype(np.int64), image.footer.index_offset)
    sizes: Counter[str] = Counter()
    for kind, size in zip(entries["record_type"], np.diff(offsets)):
        try:
            sizes[RecordType(int(kind)).name] += int(size)
        except ValueError:
            sizes[f"{int(kind):#010x}"] += int(size)
    sizes["INDEX"] += image.footer.offset - image.footer.index_offset
    return dict(sizes)


def summarize(image: LeanImage) -> dict:
    header = image.header
    counts = class_counts(image)
    logical = sum(r.size_bytes for r in image.regions)
    stored = image.footer.file_length
    links = image.chain()
    chain_stored = sum(link.footer.file_length for link in links)
    return dict(
        path=image.path,
        format_version=f"{header.major_version}.{header.minor_version}",
        image_uuid=str(uuidlib.UUID(bytes=header.image_uuid)),
        parent_uuid=str(uuidlib.UUID(bytes=header.parent_uuid)) if header.has_parent else None,
        page_size=image.page_size,
        incompatible_features=feature_names(header.incompatible_features, IncompatFeature),
        compatible_features=feature_names(header.compatible_features, CompatFeature),
        regions=[
            dict(
                region_id=r.region_id,
                name=r.name,
                guest_phys_base=r.guest_phys_base,
                size_bytes=r.size_bytes,
                pages=r.num_pages,
                classes=class_dict(class_counts(image, r)),
            )
            for r in image.regions
        ],
        disks=[
            dict(disk_id=d.disk_id, name=d.name, size_bytes=d.size_bytes, fingerprint=d.fingerprint.hex())
            for d in image.disks
        ],
        chain=[
            dict(
                path=link.path,
                image_uuid=str(uuidlib.UUID(bytes=link.header.image_uuid)),
                bytes=link.footer.file_length,
                classes=class_dict(class_counts(link)),
            )
            for link in links
        ],
        # what restoring this image needs: its memory against the bytes of every link
        chain_totals=dict(
            links=len(links),
            logical_bytes=logical,
            stored_bytes=chain_stored,
            ratio=logical / chain_stored if chain_stored else 0.0,
        ),
        source_states=len(image.source_states),
        source=describe_source(image),
        source_details=source_details(image),
        classes=class_dict(counts),
        logical_bytes=logical,
        stored_bytes=stored,
        ratio=logical / stored if stored else 0.0,
        record_bytes=record_bytes(image),
    )


def _detail_lines(details: dict | None) -> list[str]:
    """libvirt's domain (source_details) as text: name, UUID, memory, machine, was-running flag."""
    if not details or details.get("target") != "libvirt":
        return []
    memory = details.get("memory_bytes")
    details = {
        k: "".join(c if c.isprintable() else repr(c)[1:-1] for c in v) if isinstance(v, str) else v
        for k, v in details.items()
    }  # an XML value may hold newlines: one line each
    lines = [
        f"  domain  {details.get('domain_name') or '(unnamed)'}  uuid {details.get('domain_uuid') or '-'}",
        f"          memory {f'{memory / MIB:g} MiB' if memory is not None else '-'}, machine "
        f"{details.get('machine') or '-'}, was_running {'yes' if details.get('was_running') else 'no'}, "
        f"payload {details.get('compression')}",
        *(f"          disk {d['target']}: {d['file']}" for d in details.get("disks", [])),
    ]
    if details.get("xml_problem"):
        lines.append(f"          {details['xml_problem']}")
    return lines


def _names(features: list[str]) -> str:
    return ", ".join(features) if features else "(none)"


def disk_files(image: LeanImage) -> dict[str, list[dict]]:
    """Per disk, the files its DISK pages came from, largest first."""
    from .disks.files import attribute_pages

    return {
        name: [dict(path=path, pages=n, mib=n * image.page_size / MIB) for path, n in pages.most_common()]
        for name, pages in attribute_pages(image).items()
    }


def describe_source(image: LeanImage) -> str | None:
    """What the SOURCE_STATE records rebuild, as the restore target of their source format
    tells (none is loaded for an image without source state)."""
    from .errors import UnsupportedError
    from .plugins import source_targets, target

    for name in source_targets(image):
        try:
            text = target(name).describe(image)
        except UnsupportedError:  # that target is not installed
            continue
        if text:
            return text
    return None


def source_details(image: LeanImage) -> dict | None:
    """What the SOURCE_STATE records say of the save as a dict, from the first restore target
    of the image's that has a ``details`` method (libvirt's: the domain and its header)."""
    from .errors import UnsupportedError
    from .plugins import source_targets, target

    for name in source_targets(image):
        try:
            details = getattr(target(name), "details", None)
            found = details(image) if details else None
        except UnsupportedError:  # that target is not installed
            continue
        if found:
            return found
    return None


def render_text(summary: dict) -> str:
    lines = [
        f"{summary['path']}: lean image v{summary['format_version']}, page size {summary['page_size']}",
        f"  uuid    {summary['image_uuid']}",
        f"  parent  {summary['parent_uuid'] or '(none)'}",
        f"  features incompatible {_names(summary['incompatible_features'])}, compatible "
        f"{_names(summary['compatible_features'])}; {summary['source_states']} source-state records",
        *([f"  source  {summary['source']}"] if summary.get("source") else []),
        *_detail_lines(summary.get("source_details")),
        "",
        "regions:",
    ]
    for r in summary["regions"]:
        base = f"{r['guest_phys_base']:#x}" if r["guest_phys_base"] is not None else "-"
        lines.append(
            f"  [{r['region_id']}] {r['name']:<24} base {base:>12}  {r['size_bytes'] / MIB:10.2f} MiB"
            f"  {r['pages']} pages"
        )
    if summary["disks"]:
        lines += ["", "disks:"]
        for d in summary["disks"]:
            lines.append(
                f"  [{d['disk_id']}] {d['name']:<24} {d['size_bytes'] / MIB:10.2f} MiB  fingerprint {d['fingerprint']}"
            )
    if summary.get("fetched"):
        from .s3 import fetched_lines

        lines += ["", "object storage:", *fetched_lines(summary["fetched"])]
    if len(summary["chain"]) > 1:
        lines += ["", "chain (this image first):"]
        for depth, link in enumerate(summary["chain"]):
            classes = ", ".join(f"{n} {name}" for name, n in link["classes"].items())
            lines.append(f"  {depth}: {link['image_uuid']}  {link['bytes'] / MIB:8.2f} MiB  {link['path']}")
            lines.append(f"       {classes}")
    lines += ["", f"  {'class':<8} {'pages':>10} {'MiB':>10} {'%':>7}"]
    total = sum(summary["classes"].values()) or 1
    for cls in PageClass:
        pages = summary["classes"].get(cls.name, 0)
        lines.append(
            f"  {cls.name:<8} {pages:>10} {pages * summary['page_size'] / MIB:>10.2f} {100.0 * pages / total:>6.2f}%"
        )
    lines += [
        "",
        f"logical {summary['logical_bytes'] / MIB:.2f} MiB, stored {summary['stored_bytes'] / MIB:.2f} MiB, "
        f"ratio {summary['ratio']:.2f}x" + (" (this link alone)" if len(summary["chain"]) > 1 else ""),
    ]
    totals = summary["chain_totals"]
    if totals["links"] > 1:
        lines.append(
            f"chain of {totals['links']} links: logical {totals['logical_bytes'] / MIB:.2f} MiB, "
            f"stored {totals['stored_bytes'] / MIB:.2f} MiB in all links, ratio {totals['ratio']:.2f}x"
        )
    for disk, files in summary.get("disk_files", {}).items():
        lines += ["", f"DISK pages of {disk} by file:", f"  {'MiB':>10} {'pages':>8}  file"]
        lines += [f"  {f['mib']:>10.2f} {f['pages']:>8}  {f['path']}" for f in files]
    return "\n".join(lines)
