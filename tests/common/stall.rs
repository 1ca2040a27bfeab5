//! A TCP relay between a client and a server that can stall: from `stall()` on it forwards
//! nothing in either direction but keeps both connections open, as a network path that
//! went silent does (no FIN, no RST), so a client waiting for an answer waits.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct StallingRelay {
    pub port: u16,
    stalled: Arc<AtomicBool>,
}

impl StallingRelay {
    /// Listens on a loopback port and relays each connection to `127.0.0.1:target`.
    pub fn start(target: u16) -> StallingRelay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stalled = Arc::new(AtomicBool::new(false));
        let flag = stalled.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let flag = flag.clone();
                    std::thread::spawn(move || pump(from, to, &flag));
                }
            }
        });
        StallingRelay { port, stalled }
    }

    /// From now on nothing more is forwarded; the connections stay open.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, stalled: &AtomicBool) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.load(Ordering::SeqCst) {
            // Holds both sockets open and forwards nothing, for the rest of the test.
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}
