"""Developer tools (not part of the submission): see tools/kernel_report.py."""
