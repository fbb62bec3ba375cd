// What a sandbox made by a template process would cost: a measurement, not part of the runner.
//
// benchmarks/template_floor.py compiles and runs this (as root) beside bubblewrap. Once, the
// template makes its own mount namespace holding the read-only system view (/usr, the /etc view, the
// prompt's control directory) and pivots into it. Then, for each of N sandboxes, it clone()s a child
// with its own PID, network, IPC, UTS, mount and cgroup namespaces, which builds the prompt's root
// the way the local sandbox's bubblewrap line does: a tmpfs root with the system directories bound
// read-only from the view, the hidden directories empty, a /dev of its own (the harmless nodes, a
// devpts instance, /dev/shm), a fresh /proc with /proc/sys read-only, size-capped tmpfs /tmp and
// working directory, the control directory read-only; the root made read-only and moved over the
// old one (MS_MOVE + chroot: no pivot_root, whose walk over every task on the machine is ~4 % of a
// thousand-prompt run); every capability dropped, no_new_privs, a new session, a parent-death
// signal; then it execs `sh -c <command>`. Prints "<template ms> <sandboxes ms>" of CPU per sandbox.
//
// Not here (what the runner would still add): the prompt's cgroup, the masks of the host's sockets,
// resolv.conf, the network link, the request/answer protocol with the worker, a non-root variant
// (a user namespace of the template's own).
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <errno.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <sys/resource.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <linux/capability.h>
#include <fcntl.h>

static void die(const char *what) { perror(what); _exit(1); }
static void mnt(const char *src, const char *dst, const char *fs, unsigned long fl, const char *data) {
    if (mount(src, dst, fs, fl, data)) die(dst);
}
static void mkdir_p(char *path) {  // path inside the new root, modified in place
    for (char *p = path + 1; *p; p++)
        if (*p == '/') { *p = 0; mkdir(path, 0755); *p = '/'; }
    mkdir(path, 0755);
}
static char stack[1 << 16] __attribute__((aligned(16)));
static const char *VIEW = "/.view";  // the template's prepared system view (read-only binds)
static const char *SYSTEM[] = {"usr", "etc"};
static const char *LINKS[][2] = {{"usr/bin", "bin"}, {"usr/sbin", "sbin"}, {"usr/lib", "lib"}, {"usr/lib64", "lib64"}};
static const char *HIDDEN[] = {"home", "root", "run", "var", "opt", "srv", "mnt", "media"};
static const char *DEVS[] = {"null", "zero", "full", "random", "urandom", "tty"};
static const char *workdir = "/workspace";
static int child(void *arg) {
    (void)arg;
    char p[512];
    mnt(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    mnt("tmpfs", "/.new", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755");
    if (chdir("/.new")) die("chdir new");
    for (unsigned i = 0; i < sizeof SYSTEM / sizeof *SYSTEM; i++) {
        mkdir(SYSTEM[i], 0755);
        snprintf(p, sizeof p, "%s/%s", VIEW, SYSTEM[i]);
        mnt(p, SYSTEM[i], NULL, MS_BIND | MS_REC, NULL);  // keeps the view's read-only flags
    }
    for (unsigned i = 0; i < 4; i++) symlink(LINKS[i][0], LINKS[i][1]);
    for (unsigned i = 0; i < sizeof HIDDEN / sizeof *HIDDEN; i++) mkdir(HIDDEN[i], 0755);
    // /dev: a tmpfs of its own with the host's harmless nodes, a pty namespace of its own, /dev/shm
    mkdir("dev", 0755);
    mnt("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755");
    for (unsigned i = 0; i < 6; i++) {
        snprintf(p, sizeof p, "dev/%s", DEVS[i]);
        close(open(p, O_CREAT | O_WRONLY, 0666));
        char src[64]; snprintf(src, sizeof src, "/dev/%s", DEVS[i]);
        mnt(src, p, NULL, MS_BIND, NULL);
    }
    mkdir("dev/shm", 01777); mkdir("dev/pts", 0755);
    mnt("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620");
    symlink("pts/ptmx", "dev/ptmx"); symlink("/proc/self/fd", "dev/fd");
    symlink("/proc/self/fd/0", "dev/stdin"); symlink("/proc/self/fd/1", "dev/stdout"); symlink("/proc/self/fd/2", "dev/stderr");
    mkdir("proc", 0555);
    mkdir("tmp", 01777);
    mnt("tmpfs", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=4294967296,mode=1777");
    symlink("../tmp", "var/tmp");
    mkdir(".batch-runner", 0755);
    mnt("/.ctl", ".batch-runner", NULL, MS_BIND, NULL);
    mnt(NULL, ".batch-runner", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
    snprintf(p, sizeof p, ".%s", workdir); mkdir_p(p);
    mnt("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, "size=4294967296,mode=755");
    // the new root read-only, moved over the old one (no pivot_root: no walk over every task)
    mnt("/.new", "/.new", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, NULL);
    mnt(".", "/", NULL, MS_MOVE, NULL);
    if (chroot(".") || chdir("/")) die("chroot");
    mnt("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mnt("/proc/sys", "/proc/sys", NULL, MS_BIND | MS_REC, NULL);
    mnt(NULL, "/proc/sys", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    if (access("/proc/sysrq-trigger", F_OK) == 0) {
        mnt("/proc/sysrq-trigger", "/proc/sysrq-trigger", NULL, MS_BIND, NULL);
        mnt(NULL, "/proc/sysrq-trigger", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL);
    }
    setsid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    sethostname("sandbox", 7);
    for (int c = 0; c <= 63; c++) prctl(PR_CAPBSET_DROP, c, 0, 0, 0);
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2] = {{0}};
    if (syscall(SYS_capset, &h, d)) die("capset");
    if (chdir(workdir)) die("chdir workdir");
    execl("/bin/sh", "sh", "-c", (const char *)arg, (char *)NULL);
    die("exec");
    return 1;
}
static void bind_ro(const char *src, const char *dst) {
    mkdir(dst, 0755);
    mnt(src, dst, NULL, MS_BIND | MS_REC, NULL);
    mnt(NULL, dst, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
}
// template_floor <runs> <network 0|1> <command> <etc view> <control dir> <empty dir for the root>
int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s runs network command etc_view ctl_dir root_dir\n", argv[0]);
        return 2;
    }
    int runs = atoi(argv[1]);
    int net = atoi(argv[2]);
    const char *cmd = argv[3];
    const char *etc = argv[4];
    const char *ctl = argv[5];
    const char *root = argv[6];
    // Once per template: its own mount namespace with the system view, pivoted into a tmpfs.
    if (unshare(CLONE_NEWNS)) die("unshare");
    mnt(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    mkdir(root, 0755);
    mnt("tmpfs", root, "tmpfs", 0, "mode=755");
    char p[512];
    snprintf(p, sizeof p, "%s/.view", root); mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/.view/usr", root); bind_ro("/usr", p);
    snprintf(p, sizeof p, "%s/.view/etc", root); bind_ro(etc, p);
    snprintf(p, sizeof p, "%s/.ctl", root); bind_ro(ctl, p);
    snprintf(p, sizeof p, "%s/.new", root); mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/dev", root); mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/proc", root); mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/bin", root); symlink("usr/bin", p);
    snprintf(p, sizeof p, "%s/lib64", root); symlink(".view/usr/lib64", p);
    snprintf(p, sizeof p, "%s/.old", root); mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/dev", root); mnt("/dev", p, NULL, MS_BIND | MS_REC, NULL);
    snprintf(p, sizeof p, "%s/proc", root); mnt("/proc", p, NULL, MS_BIND | MS_REC, NULL);
    if (chdir(root) || syscall(SYS_pivot_root, ".", ".old") || umount2("/.old", MNT_DETACH) || chdir("/")) die("pivot");
    mnt(NULL, "/", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL);
    struct rusage a0, c0, a1, c1;
    getrusage(RUSAGE_SELF, &a0); getrusage(RUSAGE_CHILDREN, &c0);
    int flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS | CLONE_NEWCGROUP | (net ? CLONE_NEWNET : 0) | SIGCHLD;
    for (int i = 0; i < runs; i++) {
        pid_t pid = clone(child, stack + sizeof stack, flags, (void *)cmd);
        if (pid < 0) die("clone");
        int st; if (waitpid(pid, &st, 0) < 0 || st) { fprintf(stderr, "child status %d\n", st); exit(1); }
    }
    getrusage(RUSAGE_SELF, &a1); getrusage(RUSAGE_CHILDREN, &c1);
#define MS(x, y) (((y).ru_utime.tv_sec - (x).ru_utime.tv_sec + (y).ru_stime.tv_sec - (x).ru_stime.tv_sec) * 1e3 + \
                  ((y).ru_utime.tv_usec - (x).ru_utime.tv_usec + (y).ru_stime.tv_usec - (x).ru_stime.tv_usec) / 1e3)
    printf("%.3f %.3f\n", MS(a0, a1) / runs, MS(c0, c1) / runs);
    return 0;
}
