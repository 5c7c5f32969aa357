//! The guard's process tree, read from /proc.
//!
//! The guard is PID 1 or a child subreaper, so every process the app ever forks stays below it: a
//! process whose parent dies is handed to the guard. "Nothing of the app is left" is therefore "the
//! guard has no child but its watchdog and the app's own unreaped zombie", which its own children
//! list tells without walking every process on the host.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;

use nix::libc;
use nix::unistd::{getpid, Pid};

struct Entry {
    ppid: i32,
    pgid: i32,
    zombie: bool,
}

/// `/proc/<pid>/stat`: "pid (comm) state ppid pgrp ...", where comm may itself contain ") ".
fn parse_stat(stat: &str) -> Option<Entry> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_comm.split_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some(Entry {
        ppid,
        pgid,
        zombie: state == "Z" || state == "X",
    })
}

/// `None` for a process that is gone (or whose stat makes no sense); an error for one that cannot
/// be read, which callers must not take for "gone".
fn read_entry(pid: i32) -> io::Result<Option<Entry>> {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => Ok(parse_stat(&stat)),
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Every process on the host. A /proc that cannot be listed or read (no descriptor left,
/// unmounted) is an error, never "no process": the callers would take that for a tree that is gone.
fn all_processes() -> io::Result<Vec<(i32, Entry)>> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc")? {
        let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Some(read) = read_entry(pid)? {
            found.push((pid, read));
        }
    }
    Ok(found)
}

/// The live (not zombie) processes in the process group `pgid`.
pub fn live_group_members(pgid: Pid) -> io::Result<Vec<Pid>> {
    Ok(all_processes()?
        .into_iter()
        .filter(|(_, entry)| entry.pgid == pgid.as_raw() && !entry.zombie)
        .map(|(pid, _)| Pid::from_raw(pid))
        .collect())
}

/// Every live descendant of `root`, but `except` and what lies below it, from one walk of /proc.
/// Used to reach what left the app's group while `root` (the guard) is frozen: its subtree then
/// changes only by what its descendants do themselves. A process whose stat cannot be read is
/// passed over (this list is for signalling, never for "the tree is gone").
pub fn descendants(root: Pid, except: Pid) -> Vec<Pid> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: HashMap<i32, Vec<(i32, bool)>> = HashMap::new();
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Ok(Some(read)) = read_entry(pid) {
            children
                .entry(read.ppid)
                .or_default()
                .push((pid, read.zombie));
        }
    }
    let mut found = Vec::new();
    let mut seen = HashSet::from([root.as_raw()]);
    let mut parents = vec![root.as_raw()];
    while let Some(parent) = parents.pop() {
        for &(pid, zombie) in children.get(&parent).into_iter().flatten() {
            // A pid seen twice (reused during the walk) is not followed again.
            if pid != except.as_raw() && seen.insert(pid) {
                parents.push(pid);
                if !zombie {
                    found.push(Pid::from_raw(pid));
                }
            }
        }
    }
    found
}

/// Whether /proc shows this process's own PID namespace. A guard started in a new namespace without
/// its own /proc (`unshare --pid --fork` without `--mount-proc`) would read other processes' pids
/// there, and must not signal by them.
pub fn proc_is_ours() -> bool {
    fs::read_link("/proc/self")
        .ok()
        .and_then(|link| link.to_str()?.parse::<i32>().ok())
        == Some(getpid().as_raw())
}

/// The guard's direct children, zombies included, from each of its threads' children lists (a
/// process orphaned below the guard is handed to one of its threads). Where the kernel has no such
/// lists, one walk of /proc finds them by parent. A list that cannot be read is an error, not an
/// empty list: a thread that has exited has none to read, but anything else means the children are
/// unknown.
pub fn children() -> io::Result<Vec<Pid>> {
    let mut found = Vec::new();
    let mut listed = false;
    for task in fs::read_dir("/proc/self/task")?.flatten() {
        match fs::read_to_string(task.path().join("children")) {
            Ok(list) => {
                listed = true;
                found.extend(
                    list.split_whitespace()
                        .filter_map(|pid| pid.parse().ok())
                        .map(Pid::from_raw),
                );
            }
            // The thread ended, or the kernel keeps no children lists.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if !listed {
        let me = getpid().as_raw();
        found.extend(
            all_processes()?
                .into_iter()
                .filter(|(_, entry)| entry.ppid == me)
                .map(|(pid, _)| Pid::from_raw(pid)),
        );
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_a_comm_with_parentheses_and_spaces() {
        let entry = parse_stat("4242 (evil) Z 1 2 (x)) S 17 99 99 0 -1 4194560").unwrap();
        assert_eq!((entry.ppid, entry.pgid, entry.zombie), (17, 99, false));
        let zombie = parse_stat("7 (a b) Z 3 7 7 0").unwrap();
        assert_eq!((zombie.ppid, zombie.pgid, zombie.zombie), (3, 7, true));
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S notanumber 1").is_none());
    }

    #[test]
    fn this_process_sees_its_own_proc_and_its_children() {
        assert!(proc_is_ours());
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = Pid::from_raw(child.id() as i32);
        assert!(children().unwrap().contains(&pid));
        let (me, init) = (getpid(), Pid::from_raw(1));
        assert!(descendants(me, init).contains(&pid));
        assert!(!descendants(me, pid).contains(&pid));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!children().unwrap().contains(&pid));
        assert!(!descendants(me, init).contains(&pid));
    }
}
