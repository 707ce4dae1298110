"""Build hook for the C hot path; all metadata lives in pyproject.toml."""
from setuptools import setup

setup()
