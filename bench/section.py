#!/usr/bin/python3
"""Puts a file's text into a doc between a section's markers, as every bench
report does (bench/ddp/report.py's replace_section), for the scripts that
write their table from a test:  bench/section.py DOC NAME TITLE FILE"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp"))
from report import replace_section  # noqa: E402

if __name__ == "__main__":
    doc, name, title, path = sys.argv[1:5]
    replace_section(doc, name, title, open(path).read().strip() + "\n")
