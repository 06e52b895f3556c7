/* The first program of a namespace-tier launch on the host (see runner.py), run as root by
 * the spawner thread; it takes setpriv's place in front of bwrap:
 *
 *   launch UID JOIN_FDS PDEATHSIG -- PROGRAM [ARG...]
 *
 * JOIN_FDS is "-" or a comma-separated list of descriptors, each a cgroup file opened for
 * writing by Corral (v1: the "tasks" file of each hierarchy of the command's group; v2: its
 * "cgroup.procs"). Writing "0" moves the writer itself. A single thread moving itself
 * skips the kernel's global threadgroup lock, whose write side waits for an RCU grace
 * period (~10 ms here) while holding the cgroup lock: placing bwrap's child from the host
 * afterwards cost a sandbox's first command that much, and serialized a burst on it. So the
 * launch joins the group first, and bwrap and the sandbox's init are born in it.
 *
 * Then: every signal back to its default disposition and unblocked (ignored ones would
 * survive exec), no supplementary groups, real, effective and saved gid and uid UID (which
 * drops every capability), PR_SET_PDEATHSIG SIGKILL if PDEATHSIG is 1 (set after the uid
 * change, which clears it), and exec PROGRAM. Any failure: a line on stderr, exit 125;
 * nothing was run.
 *
 * Static, libc only. */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static void fail(const char *what) {
    dprintf(2, "corral-launch: %s: %s\n", what, strerror(errno));
    _exit(125);
}

static long number(const char *text, const char *what) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || value < 0) {
        errno = EINVAL;
        fail(what);
    }
    return value;
}

static void join(char *fds) {
    if (strcmp(fds, "-") == 0) return;
    for (char *item = strtok(fds, ","); item != NULL; item = strtok(NULL, ",")) {
        int fd = (int)number(item, "join descriptor");
        ssize_t wrote;
        while ((wrote = write(fd, "0", 1)) < 0 && errno == EINTR) {}
        if (wrote != 1) fail("cannot join the command's cgroup");
        close(fd);
    }
}

int main(int argc, char **argv) {
    if (argc < 6 || strcmp(argv[4], "--") != 0) {
        dprintf(2, "usage: launch UID JOIN_FDS PDEATHSIG -- PROGRAM [ARG...]\n");
        return 125;
    }
    long uid = number(argv[1], "uid");
    if (uid == 0) {
        errno = EINVAL;
        fail("uid 0");
    }
    long pdeathsig = number(argv[3], "pdeathsig");
    join(argv[2]);

    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, NULL);
    sigset_t none;
    sigemptyset(&none);
    if (sigprocmask(SIG_SETMASK, &none, NULL) < 0) fail("sigprocmask");

    if (setgroups(0, NULL) < 0) fail("setgroups");
    if (setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0) fail("setresgid");
    if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0) fail("setresuid");
    uid_t r, e, s;
    if (getresuid(&r, &e, &s) < 0 || r != (uid_t)uid || e != (uid_t)uid || s != (uid_t)uid)
        fail("uid did not change");
    if (pdeathsig == 1 && prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) fail("pdeathsig");
    execv(argv[5], argv + 5);
    fail(argv[5]);
    return 125;
}
