//! The guard's process tree, read from /proc.
//!
//! The guard is PID 1 or a child subreaper, so every process the app ever forked stays below it, even
//! after double-forking or `setsid`: "everything left of the app" is exactly the guard's descendants.

use std::collections::HashMap;
use std::fs;

use nix::unistd::Pid;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descendant {
    pub pid: Pid,
    pub pgid: Pid,
}

struct Entry {
    pid: i32,
    ppid: i32,
    pgid: i32,
    zombie: bool,
}

/// `/proc/<pid>/stat`: "pid (comm) state ppid pgrp ...", where comm may itself contain ") ".
fn read_entry(pid: i32) -> Option<Entry> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some(Entry {
        pid,
        ppid,
        pgid,
        zombie: state == "Z" || state == "X",
    })
}

/// Every process on the host, as far as /proc can be read.
fn all_processes() -> impl Iterator<Item = Entry> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(read_entry)
}

/// How many live (not zombie) processes are in the process group `pgid`.
pub fn live_group_members(pgid: Pid) -> usize {
    all_processes()
        .filter(|entry| entry.pgid == pgid.as_raw() && !entry.zombie)
        .count()
}

/// Every live (not yet dead) process below `root`.
pub fn live_descendants(root: Pid) -> Vec<Descendant> {
    let mut children: HashMap<i32, Vec<Entry>> = HashMap::new();
    for entry in all_processes() {
        children.entry(entry.ppid).or_default().push(entry);
    }
    let mut found = Vec::new();
    let mut frontier = vec![root.as_raw()];
    while let Some(parent) = frontier.pop() {
        for child in children.remove(&parent).unwrap_or_default() {
            frontier.push(child.pid);
            if !child.zombie {
                found.push(Descendant {
                    pid: Pid::from_raw(child.pid),
                    pgid: Pid::from_raw(child.pgid),
                });
            }
        }
    }
    found
}
