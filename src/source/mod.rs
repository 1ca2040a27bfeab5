//! Sources of messages. Pipe mode (stdin) lives in [`crate::pipeline`]; this module holds
//! the deterministic traffic generator used by `bench` and `demo`, and the Kafka source
//! (the only importer of rdkafka).

pub mod generator;
pub mod kafka;
