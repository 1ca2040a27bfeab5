//! `wasi:random` and `wasi:clocks/wall-clock` for handlers: the same answers on every
//! attempt of a message.
//!
//! Toolchains other than Rust's import these whether the handler uses them or not
//! (componentize-py's CPython imports `wasi:random/random` for `os.urandom` and hash
//! seeds, and the wall clock for `time.time()`). Refusing them would refuse every Python
//! handler; granting the real ones would let a retry compute different state than the
//! attempt it replaces, which G2 forbids. So they are stand-ins, shadowing wasmtime-wasi's
//! in the linker like `clock.rs` does for the monotonic clock:
//!
//! - **Random** bytes (`random`, `insecure`, `insecure-seed`) are a stream derived from
//!   the subscriber and the message id, the same inputs as `operation-key`: a retry, a
//!   redelivery after a crash or a replay reads the same bytes in the same order, another
//!   message reads others. The stream restarts at every call. It is *not* secret: anyone
//!   who knows the message id can compute it, so it must never make keys or tokens (the
//!   docs say so). Outside calls (instantiation, also the rebuild after a trap) the
//!   stream is seed zero's from its start.
//! - The **wall clock** is the message's received-at (as `now-ms`), standing still during
//!   the call; between calls it is the last message's, or zero before the first.
//!
//! The stream is xxh3-128 in counter mode over a 128-bit seed: fast (a 32-byte request
//! costs two hashes) and fixed by this file, not by a crate's choice of generator, so it
//! stays the same across dedupd versions; a test pins its first bytes.

use wasmtime_wasi::p2::bindings::clocks::wall_clock;
use wasmtime_wasi::p2::bindings::random::{insecure, insecure_seed, random};
use xxhash_rust::xxh3::xxh3_128;

use super::host::HostState;

/// A call's random stream and wall-clock time.
#[derive(Debug, Clone, Default)]
pub(crate) struct CallEntropy {
    seed: u128,
    /// Bytes of the stream handed out so far in this call.
    position: u64,
    received_at_ms: u64,
}

impl CallEntropy {
    /// Starts a call: its stream is `seed`'s from the beginning.
    pub(crate) fn start(&mut self, seed: u128, received_at_ms: u64) {
        *self = CallEntropy {
            seed,
            position: 0,
            received_at_ms,
        };
    }

    /// Ends a call: until the next one the stream is seed zero's from its start, and the
    /// clock keeps this call's time.
    pub(crate) fn end(&mut self) {
        self.seed = 0;
        self.position = 0;
    }

    /// The next `len` bytes of the stream.
    pub(crate) fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let block = self.position / 16;
            let skip = (self.position % 16) as usize;
            let mut input = [0u8; 24];
            input[..16].copy_from_slice(&self.seed.to_le_bytes());
            input[16..].copy_from_slice(&block.to_le_bytes());
            let chunk = xxh3_128(&input).to_le_bytes();
            let take = (16 - skip).min(len - out.len());
            out.extend_from_slice(&chunk[skip..skip + take]);
            self.position += take as u64;
        }
        out
    }

    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.bytes(8));
        u64::from_le_bytes(b)
    }

    fn wall_clock(&self) -> wall_clock::Datetime {
        wall_clock::Datetime {
            seconds: self.received_at_ms / 1000,
            nanoseconds: (self.received_at_ms % 1000) as u32 * 1_000_000,
        }
    }
}

impl HostState {
    /// At most this many bytes per random request: no guest can ask for more than its
    /// memory cap holds anyway, and the host must not allocate on a guest's say-so.
    fn random_len(&self, len: u64) -> wasmtime::Result<usize> {
        let cap = self.limiter.cap_bytes();
        match usize::try_from(len) {
            Ok(n) if n <= cap => Ok(n),
            _ => wasmtime::bail!(
                "the handler asked for {len} random bytes, more than its memory cap ({cap} bytes)"
            ),
        }
    }
}

impl random::Host for HostState {
    fn get_random_bytes(&mut self, len: u64) -> wasmtime::Result<Vec<u8>> {
        let n = self.random_len(len)?;
        Ok(self.entropy.bytes(n))
    }

    fn get_random_u64(&mut self) -> wasmtime::Result<u64> {
        Ok(self.entropy.u64())
    }
}

impl insecure::Host for HostState {
    fn get_insecure_random_bytes(&mut self, len: u64) -> wasmtime::Result<Vec<u8>> {
        let n = self.random_len(len)?;
        Ok(self.entropy.bytes(n))
    }

    fn get_insecure_random_u64(&mut self) -> wasmtime::Result<u64> {
        Ok(self.entropy.u64())
    }
}

impl insecure_seed::Host for HostState {
    fn insecure_seed(&mut self) -> wasmtime::Result<(u64, u64)> {
        Ok((self.entropy.u64(), self.entropy.u64()))
    }
}

impl wall_clock::Host for HostState {
    fn now(&mut self) -> wasmtime::Result<wall_clock::Datetime> {
        Ok(self.entropy.wall_clock())
    }

    fn resolution(&mut self) -> wasmtime::Result<wall_clock::Datetime> {
        Ok(wall_clock::Datetime {
            seconds: 0,
            nanoseconds: 1_000_000,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;

    #[test]
    fn the_stream_is_the_same_however_it_is_read() {
        let mut whole = CallEntropy::default();
        whole.start(42, 0);
        let all = whole.bytes(100);
        let mut parts = CallEntropy::default();
        parts.start(42, 0);
        let mut pieces = Vec::new();
        for n in [1, 15, 3, 17, 0, 64] {
            pieces.extend(parts.bytes(n));
        }
        assert_eq!(pieces, all);
        // A restart replays it; another seed gives another stream.
        whole.start(42, 0);
        assert_eq!(whole.bytes(100), all);
        whole.start(43, 0);
        assert_ne!(whole.bytes(100), all);
    }

    #[test]
    fn the_stream_is_pinned() {
        // Changing the generator changes what replays of old messages compute: don't.
        // (Computed independently: xxh3-128 of seed 1 and block 0, then block 1, little
        // endian, with Python's `xxhash`.)
        let mut e = CallEntropy::default();
        e.start(1, 0);
        let hex: String = e.bytes(20).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "95165316364e372c98ee939f2a543dfab7a7f878");
    }

    #[test]
    fn the_wall_clock_is_received_at() {
        let mut e = CallEntropy::default();
        e.start(0, 1_700_000_000_123);
        let t = e.wall_clock();
        assert_eq!((t.seconds, t.nanoseconds), (1_700_000_000, 123_000_000));
    }
}
