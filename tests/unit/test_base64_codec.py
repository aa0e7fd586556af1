"""The payloads' base64 (JSON bodies and answers) is encoded and decoded by a SIMD codec where
it is 10-30x faster than the standard library's, and gives exactly what the standard library
gives: the same bytes, the same text, and the same error (type and message) for what it refuses."""

from __future__ import annotations

import base64
import binascii

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_client import schemas as s


def _stdlib(text: str) -> bytes | tuple[type[BaseException], str]:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error) as e:
        return type(e), str(e)


def _ours(text: str) -> bytes | tuple[type[BaseException], str]:
    try:
        return s.decode_b64(text)
    except (ValueError, binascii.Error) as e:
        return type(e), str(e)


EDGES = [
    "",
    "YQ==",
    "YWI=",
    "YWJj",
    "YQ",  # padding missing
    "YQ=",
    "YQ===",  # excess padding
    "YR==",  # non-zero bits after the last byte
    "Y===",
    "=YQ=",
    "YQ==YQ==",  # data after padding
    "YW Jj",  # whitespace
    "YWJj\n",
    "YW-j",  # the URL-safe alphabet
    "YW_j",
    "YW\x00j",
    "é",  # not ASCII
    "YWJj" * 1000 + "YQ==",
    "A",
    "AA",
    "AAA",
    "////",
    "++++",
]


@pytest.mark.parametrize("text", EDGES)
def test_decoding_is_the_standard_librarys(text: str) -> None:
    assert _ours(text) == _stdlib(text)


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/= \n-_.", max_size=64)
)
def test_decoding_any_text_is_the_standard_librarys(text: str) -> None:
    assert _ours(text) == _stdlib(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=0x17F), max_size=24))
def test_decoding_any_character_is_the_standard_librarys(text: str) -> None:
    assert _ours(text) == _stdlib(text)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_encoding_is_the_standard_librarys_and_decodes_back(raw: bytes) -> None:
    text = s.encode_b64(raw)
    assert text == base64.b64encode(raw).decode("ascii")
    assert s.decode_b64(text) == raw
