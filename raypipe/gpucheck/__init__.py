"""`python -m raypipe.gpucheck`: every GPU question in one short run, on a machine with torch but no Ray.

A GPU is lent to this project now and then, for minutes, with no network and no Ray (its wheel is too big
to travel with the working tree). So everything a GPU can tell us is asked in one prepared command that
runs in about eight minutes: the GPU tests against transformers, decode and encoder throughput, and the
versions it ran with. Each question is a section (`sections.py`) run in a process of its own under its
own time budget (`plan.py`): a slow or crashing section is cut and reported, and the next one runs.
`--cpu` runs the same command on tiny presets in seconds, so the normal test suite keeps it working.
What to run there and how to read the report: docs/gpu.md.
"""
