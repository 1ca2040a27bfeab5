//! The one place that knows the whole flow: decode, key, route, wait for durable outcomes,
//! and release them in source order.

mod pipe;
mod sequencer;

pub use pipe::{run_pipe, PipeError, PipeSummary};
pub use sequencer::Sequencer;
