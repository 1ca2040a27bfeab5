//! One MQTT session over rumqttc, MQTT 3.1.1 or 5 behind one face: the client options
//! (persistent session, manual acks, window, TLS, credentials), the events the consumer
//! needs, and the acknowledgement of one message.
//!
//! Manual acks: rumqttc sends no PUBACK by itself (`set_manual_acks(true)`); the consumer
//! calls [`Client::ack`] once the message's outcome is durable. An ack queued when the
//! connection drops is discarded by rumqttc (its `clean`), and packet ids belong to one
//! connection, so the consumer never acknowledges a message of an earlier connection: the
//! broker delivers it again on the new one (DUP set) and that delivery is acknowledged.

use std::sync::Arc;

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::{
    ConnectReturnCode as Code5, Filter, Packet as Packet5, Publish as Publish5, RetainForwardRule,
    SubscribeReasonCode as Sub5,
};
use rumqttc::v5::mqttbytes::QoS as QoS5;
use rumqttc::{ConnectReturnCode as Code4, Outgoing, SubscribeReasonCode as Sub4};

use super::config::{BrokerAddr, MqttConfig, Protocol};
use super::MqttError;

/// Why a PUBACK was not queued.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AckError {
    #[error(transparent)]
    V4(Box<rumqttc::ClientError>),
    #[error(transparent)]
    V5(Box<rumqttc::v5::ClientError>),
    /// A handle from a connection of the other protocol version.
    #[error("an ack handle of the other protocol")]
    OtherProtocol,
}

/// A received message, as the consumer keys it.
pub(crate) struct Message {
    pub(crate) topic: String,
    pub(crate) payload: Bytes,
    /// The broker sent it before (DUP): a redelivery after a reconnect.
    pub(crate) dup: bool,
    /// MQTT 5 user properties in the order sent (none with 3.1.1).
    pub(crate) properties: Vec<(String, String)>,
    /// What [`Client::ack`] needs.
    pub(crate) ack: AckHandle,
}

/// The packet a PUBACK answers.
pub(crate) enum AckHandle {
    V4(Box<rumqttc::Publish>),
    V5(Box<Publish5>),
}

/// What the consumer hears from the session.
pub(crate) enum Event {
    /// CONNACK: connected; `session_present` says the broker kept the session.
    Connected {
        session_present: bool,
    },
    /// SUBACK: every filter granted (else [`Events::poll`] fails).
    Subscribed,
    Message(Message),
    /// The DISCONNECT of a stop was written (the acks queued before it are sent).
    Disconnected,
    /// Pings, acks written, anything else.
    Other,
}

/// Why a poll failed: the connection is lost (it reconnects on the next poll), or the
/// broker refused something no retry fixes.
pub(crate) enum PollError {
    Lost(String),
    Fatal(MqttError),
}

/// The half of a session that sends: subscribe, acknowledge, disconnect (cheap to clone).
#[derive(Clone)]
pub(crate) enum Client {
    V4(rumqttc::AsyncClient),
    V5(rumqttc::v5::AsyncClient),
}

/// The half that runs the connection: polled by one task only (never cancelled midway).
pub(crate) enum Events {
    V4(Box<rumqttc::EventLoop>),
    V5(Box<rumqttc::v5::EventLoop>),
}

/// The TLS client config: the CA file (else the system's roots), the client certificate,
/// with ring as the crypto provider (the one async-nats uses; no aws-lc-rs is built).
pub(crate) fn tls_config(m: &MqttConfig) -> Result<rustls::ClientConfig, MqttError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad =
        |field: &str, e: &dyn std::fmt::Display| MqttError::Config(format!("mqtt.{field}: {e}"));
    let mut roots = rustls::RootCertStore::empty();
    match &m.tls_ca_file {
        Some(path) => {
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad("tls_ca_file", &e))? {
                let cert = cert.map_err(|e| bad("tls_ca_file", &e))?;
                roots.add(cert).map_err(|e| bad("tls_ca_file", &e))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
        }
    }
    if roots.is_empty() {
        return Err(MqttError::Config(
            "mqtt: no CA certificate to verify the broker with (set mqtt.tls_ca_file)".into(),
        ));
    }
    // The process's provider: ring, the only one compiled in (as for async-nats).
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    match (&m.tls_cert_file, &m.tls_key_file) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(|e| bad("tls_cert_file", &e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad("tls_cert_file", &e))?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| bad("tls_key_file", &e))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| bad("tls_key_file", &e))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// Checks what `dedupd config check` can without connecting: the password variable and
/// the TLS files.
pub(super) fn check(m: &MqttConfig) -> Result<(), MqttError> {
    m.password().map_err(|e| MqttError::Config(e.to_string()))?;
    let addr = BrokerAddr::parse(&m.broker).map_err(|e| MqttError::Config(e.to_string()))?;
    if addr.tls {
        tls_config(m)?;
    }
    Ok(())
}

/// The session's two halves; nothing is sent before the first [`Events::poll`].
pub(crate) fn open(m: &MqttConfig) -> Result<(Client, Events), MqttError> {
    let addr = BrokerAddr::parse(&m.broker).map_err(|e| MqttError::Config(e.to_string()))?;
    let password = m.password().map_err(|e| MqttError::Config(e.to_string()))?;
    let transport = match addr.tls {
        true => Some(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Rustls(Arc::new(tls_config(m)?)),
        )),
        false => None,
    };
    let window = m.receive_maximum.get();
    // One PUBACK per packet id a connection can have in use, a subscribe and a
    // disconnect: `try_ack` never finds the channel full (an ack is a packet id, and the
    // channel allocates as it fills). A broker that sends more than the window (3.1.1 has
    // no Receive Maximum) would otherwise fill it while the connection task shares its
    // polls between reading and writing.
    let capacity = usize::from(u16::MAX) + 16;
    let timeout = m.connect_timeout.as_secs().max(1);
    let max = m.max_packet_bytes as usize;
    Ok(match m.protocol {
        Protocol::V311 => {
            let mut o = rumqttc::MqttOptions::new(&m.client_id, &addr.host, addr.port);
            o.set_clean_session(false)
                .set_manual_acks(true)
                .set_keep_alive(m.keep_alive)
                .set_max_packet_size(max, max);
            if let Some(t) = transport {
                o.set_transport(t);
            }
            if let Some(user) = &m.username {
                o.set_credentials(user, password.unwrap_or_default());
            }
            let (client, mut events) = rumqttc::AsyncClient::new(o, capacity);
            events.network_options.set_connection_timeout(timeout);
            (Client::V4(client), Events::V4(Box::new(events)))
        }
        Protocol::V5 => {
            let mut o = rumqttc::v5::MqttOptions::new(&m.client_id, &addr.host, addr.port);
            let expiry = u32::try_from(m.session_expiry.as_secs()).unwrap_or(u32::MAX);
            o.set_clean_start(false)
                .set_session_expiry_interval(Some(expiry))
                .set_receive_maximum(Some(window))
                .set_max_packet_size(Some(m.max_packet_bytes))
                .set_manual_acks(true)
                .set_keep_alive(m.keep_alive)
                .set_connection_timeout(timeout);
            if let Some(t) = transport {
                o.set_transport(t);
            }
            if let Some(user) = &m.username {
                o.set_credentials(user, password.unwrap_or_default());
            }
            let (client, events) = rumqttc::v5::AsyncClient::new(o, capacity);
            (Client::V5(client), Events::V5(Box::new(events)))
        }
    })
}

impl Client {
    /// Asks for the filters at QoS 1 (the SUBACK arrives as [`Event::Subscribed`]). MQTT 5
    /// asks for retained messages only when the subscription is new; 3.1.1 brokers send
    /// them again at every subscribe (they are duplicates while their claims live).
    pub(crate) fn subscribe(&self, filters: &[String]) -> Result<(), MqttError> {
        let failed = |e: &dyn std::fmt::Display| MqttError::Client(format!("subscribe: {e}"));
        match self {
            Client::V4(client) => {
                client
                    .try_subscribe_many(filters.iter().map(|f| {
                        rumqttc::SubscribeFilter::new(f.clone(), rumqttc::QoS::AtLeastOnce)
                    }))
                    .map_err(|e| failed(&e))
            }
            Client::V5(client) => client
                .try_subscribe_many(filters.iter().map(|f| {
                    let mut filter = Filter::new(f.clone(), QoS5::AtLeastOnce);
                    filter.retain_forward_rule = RetainForwardRule::OnNewSubscribe;
                    filter
                }))
                .map_err(|e| failed(&e)),
        }
    }

    /// Queues the PUBACK of `handle` (sent by the next polls). Call only once the outcome
    /// is durable, and only for a message of the current connection.
    pub(crate) fn ack(&self, handle: &AckHandle) -> Result<(), AckError> {
        match (self, handle) {
            (Client::V4(client), AckHandle::V4(p)) => {
                client.try_ack(p).map_err(|e| AckError::V4(Box::new(e)))
            }
            (Client::V5(client), AckHandle::V5(p)) => {
                client.try_ack(p).map_err(|e| AckError::V5(Box::new(e)))
            }
            _ => Err(AckError::OtherProtocol),
        }
    }

    /// Queues a DISCONNECT after the acks already queued (the session stays with the
    /// broker).
    pub(crate) fn disconnect(&self) {
        let r = match self {
            Client::V4(client) => client.try_disconnect().map_err(|e| e.to_string()),
            Client::V5(client) => client.try_disconnect().map_err(|e| e.to_string()),
        };
        if let Err(e) = r {
            tracing::debug!("mqtt disconnect not queued: {e}");
        }
    }
}

impl Events {
    /// The next event; connects first when the connection is down.
    pub(crate) async fn poll(&mut self) -> Result<Event, PollError> {
        match self {
            Events::V4(events) => match events.poll().await {
                Ok(rumqttc::Event::Incoming(p)) => v4_event(p),
                Ok(rumqttc::Event::Outgoing(Outgoing::Disconnect)) => Ok(Event::Disconnected),
                Ok(rumqttc::Event::Outgoing(_)) => Ok(Event::Other),
                Err(rumqttc::ConnectionError::ConnectionRefused(code)) => Err(refused4(code)),
                Err(e) => Err(PollError::Lost(e.to_string())),
            },
            Events::V5(events) => match events.poll().await {
                Ok(rumqttc::v5::Event::Incoming(p)) => v5_event(p),
                Ok(rumqttc::v5::Event::Outgoing(Outgoing::Disconnect)) => Ok(Event::Disconnected),
                Ok(rumqttc::v5::Event::Outgoing(_)) => Ok(Event::Other),
                Err(rumqttc::v5::ConnectionError::ConnectionRefused(code)) => Err(refused5(code)),
                Err(e) => Err(PollError::Lost(e.to_string())),
            },
        }
    }

    /// Drops the acks still queued: called after a lost connection has been counted, so
    /// that an ack queued for a packet id of the old connection is never sent on the new
    /// one (rumqttc's own `clean` at the failure drops those queued before it).
    pub(crate) fn drop_queued_acks(&mut self) {
        match self {
            Events::V4(e) => e.clean(),
            Events::V5(e) => e.clean(),
        }
    }
}

fn v4_event(p: rumqttc::Packet) -> Result<Event, PollError> {
    Ok(match p {
        rumqttc::Packet::ConnAck(c) => Event::Connected {
            session_present: c.session_present,
        },
        rumqttc::Packet::SubAck(s) => {
            if s.return_codes.iter().any(|c| matches!(c, Sub4::Failure)) {
                return Err(PollError::Fatal(MqttError::Config(
                    "the broker refused a subscription (SUBACK failure): check the topic filters and the user's ACL".into(),
                )));
            }
            Event::Subscribed
        }
        rumqttc::Packet::Publish(p) => Event::Message(Message {
            topic: p.topic.clone(),
            payload: p.payload.clone(),
            dup: p.dup,
            properties: Vec::new(),
            ack: AckHandle::V4(Box::new(p)),
        }),
        _ => Event::Other,
    })
}

fn v5_event(p: Packet5) -> Result<Event, PollError> {
    Ok(match p {
        Packet5::ConnAck(c) => Event::Connected {
            session_present: c.session_present,
        },
        Packet5::SubAck(s) => {
            if let Some(c) = s
                .return_codes
                .iter()
                .find(|c| !matches!(c, Sub5::Success(_)))
            {
                return Err(PollError::Fatal(MqttError::Config(format!(
                    "the broker refused a subscription ({c:?}): check the topic filters and the user's ACL"
                ))));
            }
            Event::Subscribed
        }
        Packet5::Publish(p) => Event::Message(Message {
            topic: String::from_utf8_lossy(&p.topic).into_owned(),
            payload: p.payload.clone(),
            dup: p.dup,
            properties: p
                .properties
                .as_ref()
                .map(|pr| pr.user_properties.clone())
                .unwrap_or_default(),
            ack: AckHandle::V5(Box::new(p)),
        }),
        _ => Event::Other,
    })
}

/// A refused CONNECT: credentials and client ids are fatal (a retry cannot fix them), a
/// busy or unavailable broker is retried.
fn refused4(code: Code4) -> PollError {
    match code {
        Code4::ServiceUnavailable => PollError::Lost(format!("the broker refused the connection: {code:?}")),
        _ => PollError::Fatal(MqttError::Config(format!(
            "the broker refused the connection ({code:?}): check mqtt.client_id, mqtt.username and the password variable"
        ))),
    }
}

fn refused5(code: Code5) -> PollError {
    match code {
        Code5::ServerUnavailable
        | Code5::ServerBusy
        | Code5::ConnectionRateExceeded
        | Code5::UseAnotherServer
        | Code5::ServerMoved
        | Code5::QuotaExceeded => {
            PollError::Lost(format!("the broker refused the connection: {code:?}"))
        }
        _ => PollError::Fatal(MqttError::Config(format!(
            "the broker refused the connection ({code:?}): check mqtt.client_id, mqtt.username and the password variable"
        ))),
    }
}
