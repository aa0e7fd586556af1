"""Tests of the experience pool service over HTTP (in process, both storage backends)."""
