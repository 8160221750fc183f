"""Shared test configuration: hypothesis profiles, markers."""

import os

from helpers import register_hypothesis_profiles

register_hypothesis_profiles()
os.environ.setdefault("LEANIMG_KSC_DIR", os.path.expanduser("~/.cache/leanimg/ksc"))
