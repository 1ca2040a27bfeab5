//! Sources of messages, and the step they share.
//!
//! Every source turns what it received into a [`delivery::Delivery`] and hands it to
//! [`delivery::route`], which keys, fingerprints and routes it the same way for all of
//! them (and for the replay of stored records):
//!
//! - pipe mode (stdin JSON lines): [`stdin`], each line a `pipe_line::PipeLine` (the wire
//!   type `dedupd handler test` reads too);
//! - HTTP ingest (`POST /v1/subscribers/{s}/messages`): [`http`] reads a request as a
//!   delivery; the route itself is in `crate::admin` (the only user of axum);
//! - Kafka: [`kafka`] (the only importer of rdkafka);
//! - NATS JetStream: [`nats`] (the only importer of async-nats);
//! - MQTT 3.1.1 and 5: [`mqtt`] (the only importer of rumqttc);
//! - RabbitMQ (AMQP 0-9-1): [`rabbitmq`] (the only importer of lapin);
//! - the deterministic traffic generator used by `bench` and `demo`: [`generator`].
//!
//! `readiness` holds what `/readyz` asks of the running broker sources (a connection);
//! `relay` what the outbox relays to Kafka and RabbitMQ share (counters, backlog gauges);
//! [`settle`] what the NATS, MQTT and RabbitMQ sources share between a shard's outcome and
//! the broker's acknowledgement; `bench_common` what the broker benches (`mqtt-bench`,
//! `nats-bench`, `rabbitmq-bench`) share: their traffic, ledger and timing of a source.

pub mod bench_common;
pub mod delivery;
pub mod generator;
pub mod http;
pub mod kafka;
pub mod mqtt;
pub mod nats;
pub(crate) mod pipe_line;
pub mod rabbitmq;
pub(crate) mod readiness;
pub mod relay;
pub mod settle;
pub mod stdin;
