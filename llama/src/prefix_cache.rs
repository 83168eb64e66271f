//! Prefix caching: a new sequence whose prompt starts like a recent one's takes the keys and
//! values of the shared positions from a cache instead of computing them again (a chat's long
//! system prompt, a document asked several questions, the earlier turns of a conversation).
//!
//! The design follows vLLM's automatic prefix caching in how prefixes are named, not in how
//! memory is laid out:
//!
//! - A prompt is cut into blocks of [`PREFIX_BLOCK`] tokens. Block `i` is named by a hash
//!   chained over every token before it (`h_i = hash(h_{i-1}, tokens of block i)`), so equal
//!   hashes mean equal prefixes, and two prompts share exactly the leading blocks whose
//!   hashes agree. A match is then checked token by token, so a hash collision can only cost
//!   a miss, never wrong output. Only whole blocks are cached or reused.
//! - vLLM's KV cache is paged and a cached block is shared by reference. Here every sequence
//!   owns one contiguous cache (see [`crate::batch`] for why), so an entry is a cache of its
//!   own holding a prompt's whole-block positions, and a hit *copies* those positions into the
//!   new sequence's cache: per layer one device-to-device copy of keys and one of values
//!   ([`crate::Backend::copy_kv`]). For SmolLM2-135M on the CPU (f32, 30 layers × 192 values ×
//!   2) that is 46 KB per position, a memcpy of about 46 MB for 1,000 positions: well under a
//!   millisecond of memory bandwidth against the seconds of computing them; on the GPU (f16)
//!   half of that at device bandwidth. Storing a prompt costs the same copy once.
//! - Entries are kept within a byte budget; the least recently used entry is evicted first.
//!   An entry whose prefix a newer, longer entry also holds is dropped when that one is
//!   stored.
//!
//! Reuse never changes a result. A backend computes a row with another kernel when its
//! sequence's pass has few rows ([`crate::Backend::uniform_rows_from`], e.g. decoding), and
//! the two round differently; so positions are cached only from prompt chunks at least that
//! many rows wide, and reused only by a prompt whose own chunks over them are at least that
//! wide: the cached keys and values are then bit for bit those the new prompt would compute.
//! Positions written while decoding are never cached, for the same reason.
//!
//! This module is for: finding and keeping cached prefixes. It is not for: deciding when a
//! sequence runs (that is [`crate::batch`]) or where the budget comes from (the server's
//! `--prefix-cache-bytes`).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use crate::backend::Backend;
use crate::model::KvCache;

/// Tokens per cached block: prefixes are cached and reused in whole blocks.
pub const PREFIX_BLOCK: usize = 16;

/// The chained hashes of `tokens`' whole blocks (at most `blocks` of them).
fn block_hashes(tokens: &[u32], blocks: usize) -> Vec<u64> {
    let mut previous = 0u64;
    tokens
        .chunks_exact(PREFIX_BLOCK)
        .take(blocks)
        .map(|block| {
            let mut h = DefaultHasher::new();
            previous.hash(&mut h);
            block.hash(&mut h);
            previous = h.finish();
            previous
        })
        .collect()
}

/// Counters of a [`PrefixCache`], in tokens as vLLM counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up (every prompt admitted, all its tokens).
    pub queried_tokens: u64,
    /// Prompt tokens served from the cache instead of computed.
    pub hit_tokens: u64,
    /// Bytes the entries hold now.
    pub bytes: u64,
    /// The most bytes the entries may hold.
    pub budget: u64,
    /// Entries held now.
    pub entries: usize,
}

struct Entry<B: Backend> {
    /// The cached positions' tokens (whole blocks).
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    kv: KvCache<B>,
    bytes: u64,
    /// The cache's clock when the entry was last stored or used (LRU).
    last_used: u64,
}

/// Recently computed prompt prefixes with their KV caches, within a byte budget.
pub struct PrefixCache<B: Backend> {
    budget: u64,
    entries: Vec<Entry<B>>,
    clock: u64,
    stats: PrefixCacheStats,
}

impl<B: Backend> PrefixCache<B> {
    /// An empty cache whose entries may hold `budget` bytes together.
    pub fn new(budget: u64) -> PrefixCache<B> {
        PrefixCache {
            budget,
            entries: Vec::new(),
            clock: 0,
            stats: PrefixCacheStats {
                budget,
                ..Default::default()
            },
        }
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            bytes: self.entries.iter().map(|e| e.bytes).sum(),
            entries: self.entries.len(),
            ..self.stats
        }
    }

    /// The entry sharing the longest whole-block prefix with `tokens` (at most `limit`
    /// positions) and that length, verified token by token.
    fn longest(&self, tokens: &[u32], limit: usize) -> Option<(usize, usize)> {
        let hashes = block_hashes(tokens, limit / PREFIX_BLOCK);
        let (index, blocks) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let shared = e.hashes.iter().zip(&hashes).take_while(|(a, b)| a == b);
                (i, shared.count())
            })
            .max_by_key(|&(i, blocks)| (blocks, std::cmp::Reverse(i)))?;
        let entry = &self.entries[index];
        let same = entry
            .tokens
            .iter()
            .zip(tokens)
            .take(blocks * PREFIX_BLOCK)
            .take_while(|(a, b)| a == b)
            .count();
        let positions = same / PREFIX_BLOCK * PREFIX_BLOCK;
        (positions > 0).then_some((index, positions))
    }

    /// Fills `kv` (an empty cache) with the longest cached prefix of `prompt` of at most
    /// `limit` positions and returns how many positions it holds now (0 on a miss). Counts
    /// the whole prompt as queried.
    pub fn fill(
        &mut self,
        backend: &B,
        prompt: &[u32],
        limit: usize,
        kv: &mut KvCache<B>,
    ) -> Result<usize, crate::LlamaError> {
        self.stats.queried_tokens += prompt.len() as u64;
        let Some((index, positions)) = self.longest(prompt, limit.min(prompt.len())) else {
            return Ok(0);
        };
        if !kv.copy_prefix_from(backend, &self.entries[index].kv, positions)? {
            return Ok(0);
        }
        self.clock += 1;
        self.entries[index].last_used = self.clock;
        self.stats.hit_tokens += positions as u64;
        Ok(positions)
    }

    /// Whether storing `positions` positions of `tokens` would add anything: some are not
    /// cached yet, and they fit the budget.
    pub fn wants(&self, tokens: &[u32], positions: usize, bytes: u64) -> bool {
        let positions = positions / PREFIX_BLOCK * PREFIX_BLOCK;
        positions > 0
            && bytes <= self.budget
            && self
                .longest(tokens, positions)
                .is_none_or(|(_, cached)| cached < positions)
    }

    /// Keeps `kv` (holding the first `kv.len()` positions of `tokens`, whole blocks) as an
    /// entry of `bytes`; drops the entries whose prefix it also holds and, least recently used
    /// first, those it needs the room of.
    pub fn store(&mut self, tokens: &[u32], kv: KvCache<B>, bytes: u64) {
        let positions = kv.len() / PREFIX_BLOCK * PREFIX_BLOCK;
        if positions == 0 || bytes > self.budget || positions > tokens.len() {
            return;
        }
        let tokens = tokens[..positions].to_vec();
        let hashes = block_hashes(&tokens, positions / PREFIX_BLOCK);
        self.entries
            .retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        let mut used: u64 = self.entries.iter().map(|e| e.bytes).sum();
        while used + bytes > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
            else {
                break;
            };
            used -= self.entries.swap_remove(oldest).bytes;
        }
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            hashes,
            kv,
            bytes,
            last_used: self.clock,
        });
    }
}

/// Positions of a prompt of `len` tokens, computed in chunks of `chunk` rows from its start,
/// that lie in chunks at least `wide` rows long (all of them, or all but a short last chunk).
pub fn positions_in_wide_chunks(len: usize, chunk: usize, wide: usize) -> usize {
    if len == 0 || chunk < wide {
        return 0;
    }
    let last_start = (len - 1) / chunk * chunk;
    if len - last_start >= wide {
        len
    } else {
        last_start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hashes_are_chained_over_the_prefix() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (block_hashes(&a, 10), block_hashes(&b, 10));
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[0], hb[0]);
        // Block 2 has equal tokens but follows a different block 1.
        assert_ne!(ha[1], hb[1]);
        assert_ne!(ha[2], hb[2]);
        assert_eq!(block_hashes(&a, 2).len(), 2);
    }

    #[test]
    fn positions_in_wide_chunks_drop_only_a_short_last_chunk() {
        assert_eq!(positions_in_wide_chunks(1000, 4096, 16), 1000);
        assert_eq!(positions_in_wide_chunks(10, 4096, 16), 0);
        assert_eq!(positions_in_wide_chunks(600, 512, 16), 600);
        assert_eq!(positions_in_wide_chunks(520, 512, 16), 512);
        assert_eq!(positions_in_wide_chunks(512, 512, 16), 512);
        assert_eq!(positions_in_wide_chunks(0, 512, 16), 0);
        // Chunks narrower than `wide` are never wide.
        assert_eq!(positions_in_wide_chunks(100, 8, 16), 0);
    }
}
