"""``truncate_largest_array_file(step_dir)``: damage an orbax checkpoint step as a full disk or
an interrupted copy would, by cutting its largest array data file (``<step>/state/**/d/*``) to
half its size. Its metadata stays readable; restoring its arrays fails."""

from pathlib import Path


def truncate_largest_array_file(step_dir: Path) -> Path:
    """Halves the step's largest array data file; returns its path."""
    files = [p for p in (Path(step_dir) / "state").rglob("*") if p.is_file()
             and p.parent.name == "d"]
    largest = max(files, key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    return largest
