"""Legacy entry point: all metadata lives in pyproject.toml, which setuptools reads from here too.

pip (``pip install ./``, ``pip install --editable ./``) uses pyproject.toml's build backend and
does not need this file; it serves tools that still run ``python setup.py ...``.
"""
from setuptools import setup

setup()
