//! Launch environment and the TCP rendezvous that hands NCCL's unique id from rank 0 to every rank.
//!
//! Works under `torchrun` (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and under
//! Slurm `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, with `MASTER_ADDR`/`MASTER_PORT`
//! exported by the batch script, as for torch jobs). The rendezvous listens on
//! `SHARDSCOPE_RDZV_PORT` if set, else on `MASTER_PORT + 1`: under `torchrun` the agent's store
//! already owns `MASTER_PORT` itself.
//!
//! Protocol: rank 0 listens on all interfaces; every other rank connects to `MASTER_ADDR` (retrying
//! until the deadline), sends `SSRV` + its rank (u32 LE), and receives `SSRV` + payload length
//! (u32 LE) + payload.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"SSRV";
/// Largest payload accepted (NCCL's unique id is 128 bytes).
const MAX_PAYLOAD: u32 = 4096;

/// Why the launch environment or the rendezvous failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RendezvousError {
    /// A launcher variable is missing.
    #[error(
        "environment variable {name} is not set (launch with torchrun, or srun with MASTER_ADDR and MASTER_PORT exported)"
    )]
    MissingVar { name: &'static str },
    /// A launcher variable is not a number in range.
    #[error("environment variable {name}={value} is not valid: {reason}")]
    BadVar {
        name: &'static str,
        value: String,
        reason: &'static str,
    },
    /// Network failure (bind, connect, read or write).
    #[error("rendezvous with {peer} on port {port}: {what}")]
    Io {
        peer: String,
        port: u16,
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// No peer showed up (or rank 0 never answered) before the deadline.
    #[error("rendezvous on port {port} timed out after {secs} s ({what})")]
    Timeout { port: u16, secs: u64, what: String },
    /// A peer spoke another protocol.
    #[error("rendezvous on port {port}: unexpected message from {peer}")]
    Protocol { port: u16, peer: String },
}

/// The process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaunchEnv {
    pub(crate) rank: u64,
    pub(crate) world_size: u64,
    /// GPU index on this node.
    pub(crate) local_rank: u64,
    pub(crate) master_addr: String,
    pub(crate) master_port: u16,
    /// The rendezvous port (see the module documentation).
    pub(crate) rendezvous_port: u16,
    /// `torchrun` or `slurm`.
    pub(crate) launcher: &'static str,
}

fn parse_u64(name: &'static str, value: &str) -> Result<u64, RendezvousError> {
    value.trim().parse().map_err(|_| RendezvousError::BadVar {
        name,
        value: value.to_owned(),
        reason: "not a non-negative integer",
    })
}

impl LaunchEnv {
    /// Reads the launcher's variables through `var` (`std::env::var` in the binary).
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, RendezvousError> {
        let get = |name: &'static str| var(name).ok_or(RendezvousError::MissingVar { name });
        let (rank, world_size, local_rank, launcher) = if var("RANK").is_some() {
            (
                parse_u64("RANK", &get("RANK")?)?,
                parse_u64("WORLD_SIZE", &get("WORLD_SIZE")?)?,
                var("LOCAL_RANK").map_or(Ok(0), |v| parse_u64("LOCAL_RANK", &v))?,
                "torchrun",
            )
        } else if var("SLURM_PROCID").is_some() {
            (
                parse_u64("SLURM_PROCID", &get("SLURM_PROCID")?)?,
                parse_u64("SLURM_NTASKS", &get("SLURM_NTASKS")?)?,
                var("SLURM_LOCALID").map_or(Ok(0), |v| parse_u64("SLURM_LOCALID", &v))?,
                "slurm",
            )
        } else {
            return Err(RendezvousError::MissingVar { name: "RANK" });
        };
        if world_size == 0 || rank >= world_size {
            return Err(RendezvousError::BadVar {
                name: "RANK",
                value: rank.to_string(),
                reason: "must be below WORLD_SIZE",
            });
        }
        let master_addr = get("MASTER_ADDR")?;
        let port_text = get("MASTER_PORT")?;
        let master_port = port_text
            .trim()
            .parse::<u16>()
            .map_err(|_| RendezvousError::BadVar {
                name: "MASTER_PORT",
                value: port_text.clone(),
                reason: "not a TCP port",
            })?;
        let rendezvous_port = match var("SHARDSCOPE_RDZV_PORT") {
            Some(v) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| RendezvousError::BadVar {
                    name: "SHARDSCOPE_RDZV_PORT",
                    value: v.clone(),
                    reason: "not a TCP port",
                })?,
            None => master_port.checked_add(1).ok_or(RendezvousError::BadVar {
                name: "MASTER_PORT",
                value: port_text,
                reason: "65535 leaves no port for the rendezvous; set SHARDSCOPE_RDZV_PORT",
            })?,
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            rendezvous_port,
            launcher,
        })
    }
}

fn io_err(peer: &str, port: u16, what: &str) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let (peer, what) = (peer.to_owned(), what.to_owned());
    move |source| RendezvousError::Io {
        peer,
        port,
        what,
        source,
    }
}

/// Rank 0: serves `payload` to the `world_size - 1` other ranks.
#[cfg(feature = "cuda")]
pub(crate) fn serve(
    port: u16,
    world_size: u64,
    payload: &[u8],
    timeout: Duration,
) -> Result<(), RendezvousError> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(io_err("0.0.0.0", port, "bind"))?;
    serve_on(&listener, world_size, payload, timeout)
}

/// [`serve`] on an already bound listener.
pub(crate) fn serve_on(
    listener: &TcpListener,
    world_size: u64,
    payload: &[u8],
    timeout: Duration,
) -> Result<(), RendezvousError> {
    let port = listener.local_addr().map_or(0, |a| a.port());
    listener
        .set_nonblocking(true)
        .map_err(io_err("listener", port, "set_nonblocking"))?;
    let deadline = Instant::now() + timeout;
    let mut served = 0u64;
    let want = world_size.saturating_sub(1);
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .min(MAX_PAYLOAD);
    while served < want {
        match listener.accept() {
            Ok((mut stream, addr)) => {
                let peer = addr.to_string();
                stream
                    .set_nonblocking(false)
                    .map_err(io_err(&peer, port, "set_blocking"))?;
                stream
                    .set_read_timeout(Some(Duration::from_secs(30)))
                    .map_err(io_err(&peer, port, "set timeout"))?;
                let mut hello = [0u8; 8];
                stream
                    .read_exact(&mut hello)
                    .map_err(io_err(&peer, port, "read hello"))?;
                if &hello[..4] != MAGIC {
                    return Err(RendezvousError::Protocol { port, peer });
                }
                let mut msg = Vec::with_capacity(8 + payload.len());
                msg.extend_from_slice(MAGIC);
                msg.extend_from_slice(&len.to_le_bytes());
                msg.extend_from_slice(&payload[..len as usize]);
                stream
                    .write_all(&msg)
                    .map_err(io_err(&peer, port, "send payload"))?;
                served += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(RendezvousError::Timeout {
                        port,
                        secs: timeout.as_secs(),
                        what: format!("{served} of {want} ranks connected"),
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(io_err("listener", port, "accept")(e)),
        }
    }
    Ok(())
}

/// Any rank but 0: fetches the payload from rank 0 at `addr:port`, retrying until `timeout`.
pub(crate) fn fetch(
    addr: &str,
    port: u16,
    rank: u64,
    timeout: Duration,
) -> Result<Vec<u8>, RendezvousError> {
    let deadline = Instant::now() + timeout;
    let peer = format!("{addr}:{port}");
    loop {
        let attempt = (|| -> Result<Vec<u8>, RendezvousError> {
            let sock = (addr, port)
                .to_socket_addrs()
                .map_err(io_err(&peer, port, "resolve MASTER_ADDR"))?
                .next()
                .ok_or_else(|| RendezvousError::Protocol {
                    port,
                    peer: peer.clone(),
                })?;
            let mut stream = TcpStream::connect_timeout(&sock, Duration::from_secs(2))
                .map_err(io_err(&peer, port, "connect"))?;
            stream
                .set_read_timeout(Some(Duration::from_secs(30)))
                .map_err(io_err(&peer, port, "set timeout"))?;
            let mut hello = Vec::with_capacity(8);
            hello.extend_from_slice(MAGIC);
            hello.extend_from_slice(&u32::try_from(rank).unwrap_or(u32::MAX).to_le_bytes());
            stream
                .write_all(&hello)
                .map_err(io_err(&peer, port, "send hello"))?;
            let mut head = [0u8; 8];
            stream
                .read_exact(&mut head)
                .map_err(io_err(&peer, port, "read reply"))?;
            let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
            if &head[..4] != MAGIC || len > MAX_PAYLOAD {
                return Err(RendezvousError::Protocol {
                    port,
                    peer: peer.clone(),
                });
            }
            let mut payload = vec![0u8; len as usize];
            stream
                .read_exact(&mut payload)
                .map_err(io_err(&peer, port, "read payload"))?;
            Ok(payload)
        })();
        match attempt {
            Ok(p) => return Ok(p),
            Err(RendezvousError::Io { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(RendezvousError::Io { .. }) => {
                return Err(RendezvousError::Timeout {
                    port,
                    secs: timeout.as_secs(),
                    what: format!("rank 0 at {peer} did not answer"),
                });
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn torchrun_and_slurm_variables() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let env = LaunchEnv::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.rendezvous_port
            ),
            (3, 8, 3, 29501)
        );
        assert_eq!(env.launcher, "torchrun");
        let env = LaunchEnv::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "12000"),
            ("SHARDSCOPE_RDZV_PORT", "13000"),
        ]))
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.rendezvous_port
            ),
            (5, 16, 1, 13000)
        );
        assert_eq!(env.launcher, "slurm");
        let err = LaunchEnv::from_vars(vars(&[("RANK", "8"), ("WORLD_SIZE", "8")])).unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
        let err = LaunchEnv::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn rank0_hands_the_payload_to_every_rank() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let payload: Vec<u8> = (0..128u8).collect();
        let got = std::thread::scope(|s| {
            let server = s.spawn(|| serve_on(&listener, 4, &payload, Duration::from_secs(20)));
            let clients: Vec<_> = (1..4)
                .map(|r| s.spawn(move || fetch("127.0.0.1", port, r, Duration::from_secs(20))))
                .collect();
            let got: Vec<Vec<u8>> = clients
                .into_iter()
                .map(|c| c.join().unwrap().unwrap())
                .collect();
            server.join().unwrap().unwrap();
            got
        });
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|g| *g == payload));
    }
}
