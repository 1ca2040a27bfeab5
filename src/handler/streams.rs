//! `wasi:io/streams` for handlers, without a trip through a Tokio runtime for every write.
//!
//! wasmtime-wasi's synchronous bindings run each blocking stream call (`blocking-write-and-flush`,
//! the drop of a stream, ...) inside `in_tokio`, which enters a runtime and blocks on the
//! future: on a shard thread, outside any runtime, that costs more than the write itself.
//! A guest's `println!` is one such call per line, so a handler printing 4,096 lines per
//! message (`fixture-log-flood`) spent most of its ~5 ms per message there, on the shard
//! thread that other subscribers share (`dedupd bench adversarial`). A handler's streams are
//! its captured stdout and stderr (`output.rs`), always ready: here a call's future is
//! polled once, and only one that is not ready at once goes on to `in_tokio` as before.

use std::future::Future;
use std::pin::pin;

use wasmtime::component::{HasData, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::io::streams::{
    HostInputStream as AsyncIn, HostOutputStream as AsyncOut,
};
use wasmtime_wasi::p2::bindings::sync::io::poll::Pollable;
use wasmtime_wasi::p2::bindings::sync::io::streams::{
    self, Host, HostInputStream, HostOutputStream, InputStream, OutputStream,
};
use wasmtime_wasi::p2::{StreamError, StreamResult};
use wasmtime_wasi::runtime::{in_tokio, poll_noop};

/// The handler's resource table, seen as `wasi:io/streams`.
pub(crate) struct Streams<'a>(pub(crate) &'a mut ResourceTable);

/// Links [`Streams`] into a linker (shadowing wasmtime-wasi's).
pub(crate) struct HasStreams;

impl HasData for HasStreams {
    type Data<'a> = Streams<'a>;
}

/// The future's output if it is ready at its first poll, else the output of blocking on it
/// in a Tokio runtime as wasmtime-wasi does.
fn ready_or_block<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match poll_noop(f.as_mut()) {
        Some(out) => out,
        None => in_tokio(f),
    }
}

impl Host for Streams<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        Host::convert_stream_error(self.0, err)
    }
}

impl HostOutputStream for Streams<'_> {
    fn drop(&mut self, stream: Resource<OutputStream>) -> wasmtime::Result<()> {
        ready_or_block(AsyncOut::drop(self.0, stream))
    }

    fn check_write(&mut self, stream: Resource<OutputStream>) -> StreamResult<u64> {
        HostOutputStream::check_write(self.0, stream)
    }

    fn write(&mut self, stream: Resource<OutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        HostOutputStream::write(self.0, stream, bytes)
    }

    fn blocking_write_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        bytes: Vec<u8>,
    ) -> StreamResult<()> {
        ready_or_block(AsyncOut::blocking_write_and_flush(self.0, stream, bytes))
    }

    fn blocking_write_zeroes_and_flush(
        &mut self,
        stream: Resource<OutputStream>,
        len: u64,
    ) -> StreamResult<()> {
        ready_or_block(AsyncOut::blocking_write_zeroes_and_flush(
            self.0, stream, len,
        ))
    }

    fn subscribe(
        &mut self,
        stream: Resource<OutputStream>,
    ) -> wasmtime::Result<Resource<Pollable>> {
        HostOutputStream::subscribe(self.0, stream)
    }

    fn write_zeroes(&mut self, stream: Resource<OutputStream>, len: u64) -> StreamResult<()> {
        HostOutputStream::write_zeroes(self.0, stream, len)
    }

    fn flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        HostOutputStream::flush(self.0, stream)
    }

    fn blocking_flush(&mut self, stream: Resource<OutputStream>) -> StreamResult<()> {
        let borrowed = Resource::new_borrow(stream.rep());
        ready_or_block(AsyncOut::blocking_flush(self.0, borrowed))
    }

    fn splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        HostOutputStream::splice(self.0, dst, src, len)
    }

    fn blocking_splice(
        &mut self,
        dst: Resource<OutputStream>,
        src: Resource<InputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        ready_or_block(AsyncOut::blocking_splice(self.0, dst, src, len))
    }
}

impl HostInputStream for Streams<'_> {
    fn drop(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<()> {
        ready_or_block(AsyncIn::drop(self.0, stream))
    }

    fn read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        HostInputStream::read(self.0, stream, len)
    }

    fn blocking_read(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<Vec<u8>> {
        ready_or_block(AsyncIn::blocking_read(self.0, stream, len))
    }

    fn skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        HostInputStream::skip(self.0, stream, len)
    }

    fn blocking_skip(&mut self, stream: Resource<InputStream>, len: u64) -> StreamResult<u64> {
        ready_or_block(AsyncIn::blocking_skip(self.0, stream, len))
    }

    fn subscribe(&mut self, stream: Resource<InputStream>) -> wasmtime::Result<Resource<Pollable>> {
        HostInputStream::subscribe(self.0, stream)
    }
}
