"""`leanimg plugins`: the installed source formats and restore targets, broken ones with why."""

from __future__ import annotations

from .plugins import Installed


def render_text(found: list[Installed]) -> str:
    """One line per plugin: kind, name, what it is (or BROKEN and why), who provides it, entry point."""
    rows = [
        (
            p.kind,
            p.name,
            f"BROKEN: {p.problem}" if p.problem else p.description or "",
            f"{p.distribution} {p.version}" if p.distribution else "(unknown distribution)",
            p.entry_point,
        )
        for p in found
    ]
    if not rows:
        return "no plugins installed"
    widths = [max(len(row[k]) for row in rows) for k in range(2)]
    return "\n".join(
        f"{kind:<{widths[0]}}  {name:<{widths[1]}}  {what}\n{'':<{widths[0] + widths[1] + 4}}from {provider}: {entry}"
        for kind, name, what, provider, entry in rows
    )
