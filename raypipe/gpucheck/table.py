"""The report as text: one line per section (status, time against budget), then its rows and its skips."""

from __future__ import annotations

from raypipe.bench.common import print_table

SUMMARY_KEYS = ("gpu", "cuda", "python", "ray_imported", "pytest_summary", "peak_tflops")


def describe(report: dict) -> None:
    print(f"raypipe GPU check on {report['device']} ({'dry run, ' if report['device'] == 'cpu' else ''}"
          f"{report['seconds']:.0f} s of {report['budget_s']:.0f} s)")
    print_table("sections", ["section", "status", "seconds", "budget s", "rows", "skipped", "Ray imported"],
                [[name, s["status"], s["seconds"], s["budget_s"], len(s.get("results", [])),
                  len(s.get("skipped", [])), s.get("ray_imported", "?")] for name, s in report["sections"].items()])
    for name, section in report["sections"].items():
        facts = {k: section[k] for k in SUMMARY_KEYS if k in section}
        if facts:
            print(f"\n{name}: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        rows = section.get("results", [])
        if rows:
            headers = list(dict.fromkeys(k for row in rows for k in row if k not in ("message", "path")))
            print_table(name, headers, [[row.get(h, "") for h in headers] for row in rows])
        for row in rows:
            if "message" in row:
                print(f"  {row.get('test', '')} {row.get('outcome', '')}: {row['message'][:300]}")
        for skip in section.get("skipped", []):
            print(f"  skipped {skip['item']}: {skip['reason'][:300]}")
        if section["status"] != "ok":
            print(f"  {name} {section['status']}; output tail:\n{section.get('output_tail', '')[-1500:]}")
