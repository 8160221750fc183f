"""`leanimg validate-hints`: every violation of spec/hints.md in a hint file, with its rule id.

The structural rules (LI-HNT-001..016) are checked on the file alone. With ``--save`` the
rules that need the save (page size, address map, ranges within guest memory, stream offsets
within the stream) are checked too, the save read through its source plugin; with
``--image`` (an image converted from the save) the same but stream offsets, plus the disks
against the image's disk table and the parent against its parent_uuid.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedError
from .hints import Guest, HintError, check_against, check_hints
from .validate import Verdict

MAX_PER_RULE = 20


@dataclass
class HintReport(Verdict):
    records: int = 0

    def add(self, finding: HintError) -> None:
        if sum(f.rule == finding.rule for f in self.findings) >= MAX_PER_RULE:
            self.suppressed[finding.rule] += 1
        else:
            self.findings.append(finding)

    def to_json(self) -> dict:
        return dict(self.verdict_json(), records=self.records)


def validate_hints(path: str, *, save: str | None = None, image: str | None = None) -> HintReport:
    report = HintReport(path)
    hints, findings = check_hints(path)
    for finding in findings:
        report.add(finding)
    if hints is None:
        return report
    report.records = len(hints.records)
    guest = _guest(save, image) if save or image else None
    if guest is None:
        report.skip("LI-HNT-017..021: give --save or --image to check the hints against the guest")
    else:
        if guest.stream_length is None:
            report.skip("LI-HNT-019: stream offsets need --save (an image does not record the stream's length)")
        for finding in check_against(hints, guest):
            report.add(finding)
    return report


def _guest(save: str | None, image: str | None) -> Guest:
    if save:
        from .plugins import HEAD_BYTES, detect_source

        with open(save, "rb") as f:
            source = detect_source(f.read(HEAD_BYTES))
        describe = getattr(source, "guest", None)  # optional: a plugin may not offer it
        if describe is None:
            raise UnsupportedError(
                f"the {source.name} source plugin cannot describe its saves for hint checks: "
                "convert the save and give --image",
                structure="--save",
            )
        return describe(save)
    assert image is not None  # (the caller gives a save or an image)
    return guest_of_image(image)


def guest_of_image(path: str) -> Guest:
    """What hints are checked against, from an image converted from the save they are for."""
    from .format import SourceFormat
    from .reader import LeanImage

    with LeanImage.open_link(path) as img:
        formats = {s.source_format for s in img.source_states}
        source = "xen" if SourceFormat.XEN in formats else "qemu"
        parent = img.header.parent_uuid if any(img.header.parent_uuid) else None
        return Guest(
            img.page_size,
            source,
            {r.name: r.num_pages for r in img.regions},
            None,
            {d.name: d.size_bytes for d in img.disks},
            parent,
        )
