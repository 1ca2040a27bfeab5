//! Sources of messages. Pipe mode (stdin) lives in [`crate::pipeline`]; this module holds
//! the deterministic traffic generator used by `bench` and `demo`.

pub mod generator;
