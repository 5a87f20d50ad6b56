"""Prefix caching: full blocks are identified by a hash chain over their token ids.

The hash of block i covers the hash of block i-1 and block i's tokens, so equal hashes mean
equal whole prefixes, not just equal blocks. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = b"jaxserve-prefix-root"


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    # NOTE: a cryptographic digest, so distinct prefixes never share KV by accident.
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}i", *token_ids), digest_size=16).digest()


def root_hash(salt: str) -> bytes:
    """The chain's root for requests whose KV depends on more than their tokens (a LoRA
    adapter: the same tokens give other keys and values), so their blocks never match others'."""
    return hash_block(ROOT_HASH + salt.encode(), [])


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        root: bytes = ROOT_HASH) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet (in place)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
