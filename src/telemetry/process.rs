//! The process metrics every Prometheus client library exports (`process_*`, the names
//! of the Prometheus client guidelines), read from Linux's `/proc` at scrape time. Written
//! here rather than taken from a crate: the readers are a few lines over text the engine
//! already parses for its resident memory, and the crates that do it bring `procfs` and
//! some thirty packages into every build.

/// Prometheus names and their `# HELP` texts.
pub const HELP: &[(&str, &str)] = &[
    (
        CPU_SECONDS_TOTAL,
        "Total user and system CPU time spent, in seconds.",
    ),
    (RESIDENT_MEMORY_BYTES, "Resident memory size in bytes."),
    (VIRTUAL_MEMORY_BYTES, "Virtual memory size in bytes."),
    (OPEN_FDS, "Number of open file descriptors."),
    (
        MAX_FDS,
        "Maximum number of open file descriptors (the soft limit).",
    ),
    (
        START_TIME_SECONDS,
        "Start time of the process since the Unix epoch, in seconds.",
    ),
    (THREADS, "Number of OS threads in the process."),
];
pub(crate) const CPU_SECONDS_TOTAL: &str = "process_cpu_seconds_total";
pub(crate) const RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
pub(crate) const VIRTUAL_MEMORY_BYTES: &str = "process_virtual_memory_bytes";
pub(crate) const OPEN_FDS: &str = "process_open_fds";
pub(crate) const MAX_FDS: &str = "process_max_fds";
pub(crate) const START_TIME_SECONDS: &str = "process_start_time_seconds";
pub(crate) const THREADS: &str = "process_threads";

/// `/proc/<pid>/stat` counts CPU time and the start in clock ticks of `USER_HZ`, which
/// the kernel fixes at 100 for user space on every architecture (`sysconf(_SC_CLK_TCK)`).
const TICKS_PER_SECOND: f64 = 100.0;

/// One reading of this process.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProcessStats {
    pub(crate) cpu_seconds: f64,
    pub(crate) resident_bytes: u64,
    pub(crate) virtual_bytes: u64,
    pub(crate) open_fds: u64,
    pub(crate) max_fds: Option<u64>,
    pub(crate) start_time_seconds: f64,
    pub(crate) threads: u64,
}

/// This process now; `None` off Linux or when `/proc` is not mounted.
pub(crate) fn read() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    parse(&stat, &boot, &status, &limits, open_fds)
}

/// Parses the texts of `/proc/self/stat`, `/proc/stat`, `/proc/self/status` and
/// `/proc/self/limits`.
fn parse(
    stat: &str,
    boot: &str,
    status: &str,
    limits: &str,
    open_fds: u64,
) -> Option<ProcessStats> {
    // The command name (field 2) is in parentheses and may hold spaces and parentheses:
    // the fields after it start past the last ')'. Field 3 (state) is then index 0.
    let after = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { f.get(n - 3)?.parse().ok() };
    let (utime, stime) = (field(14)?, field(15)?);
    let btime: u64 = boot
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let max_fds = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok());
    Some(ProcessStats {
        cpu_seconds: (utime + stime) as f64 / TICKS_PER_SECOND,
        resident_bytes: super::vm_rss(status)?,
        virtual_bytes: field(23)?,
        open_fds,
        max_fds,
        start_time_seconds: btime as f64 + field(22)? as f64 / TICKS_PER_SECOND,
        threads: field(20)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_texts_are_read_field_by_field() {
        // A command name with a space and a parenthesis, as `comm` allows.
        let stat = "4242 (dedupd (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 75 0 0 20 0 9 0 123456 987654321 3000 18446744073709551615";
        let boot = "cpu  1 2 3\nbtime 1765000000\nprocesses 10\n";
        let status = "Name:\tdedupd\nVmRSS:\t   2048 kB\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            65536                524288               files\n";
        let s = parse(stat, boot, status, limits, 17).unwrap();
        assert_eq!(
            s,
            ProcessStats {
                cpu_seconds: 3.25,
                resident_bytes: 2048 * 1024,
                virtual_bytes: 987_654_321,
                open_fds: 17,
                max_fds: Some(65536),
                start_time_seconds: 1_765_000_000.0 + 1234.56,
                threads: 9,
            }
        );
    }

    #[test]
    fn this_process_reads_as_itself() {
        let s = read().expect("Linux /proc");
        assert!(
            s.cpu_seconds >= 0.0 && s.threads >= 1 && s.open_fds >= 3,
            "{s:?}"
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        // Started before now and not before the test binary was built (a day is plenty).
        assert!(s.start_time_seconds <= now + 1.0, "{s:?}");
        assert!(s.start_time_seconds > now - 86_400.0, "{s:?}");
    }
}
